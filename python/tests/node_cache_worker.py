"""One rank of a stage-3 job that trains stage3_common's model on the full
batch for its STEPS steps, then leaves (test_node_cache.py's other rank).

Usage: node_cache_worker.py CONFIG_JSON OUT (OUT is not written)
"""

import json
import sys

import stage3_common as sc


def main():
    model, _ = sc.train_in_process(json.loads(sys.argv[1]), stage=3)
    model.close()


if __name__ == "__main__":
    main()
