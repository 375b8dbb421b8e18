"""Checks on how zeroshard.torch uses its client, shared by the tests."""


class _NoWholeModelGather:
    """The client, except that gather_all (a buffer for the whole model's
    fp32 masters) is refused."""

    def __init__(self, client):
        self._client = client

    def gather_all(self, out):
        raise AssertionError("the load gathered the whole model's masters at once")

    def __getattr__(self, name):
        return getattr(self._client, name)


def refuse_whole_model_gather(model):
    """From now on `model` (stages 1-2) must load its parameters layer by
    layer: a gather of the whole model raises AssertionError."""
    model._engine.client = _NoWholeModelGather(model._engine.client)
