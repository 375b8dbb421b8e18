"""ZeRO-as-a-service client: shard optimizer states on zeroshardd daemons.

`Client` pushes gradients, runs the two-phase step and gathers parameters;
`zeroshard.torch.ShardedOptimizer` wraps it as a drop-in for AdamW, and
`zeroshard.torch.shard_model` shards a whole module (stage 3: its
parameters too, gathered layer by layer).
Failures raise `Error` (a RuntimeError) whose `.code` names the status code.
"""

# The project's version; //python:wheel names the wheel after it.
__version__ = "0.1.0"

from zeroshard._zeroshard import ActivationStore, ActivationTicket, Client, Error, Layout

__all__ = ["ActivationStore", "ActivationTicket", "Client", "Error", "Layout"]
