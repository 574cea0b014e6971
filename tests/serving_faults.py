"""A kvbridge connector whose map fails for prompts that start with FAULT_MARKER (the serving tests' injected
failure: every other request goes through the real connector unchanged). Loaded by the engine from this folder: the
connector is the real facade, its worker side (where the map runs) a subclass of the real worker."""

from kvbridge.serving.engine.connector import KVBridgeConnector
from kvbridge.serving.engine.target_worker import KVBridgeWorker

FAULT_MARKER = "# FAULT INJECTED HERE\n"


class FaultyWorker(KVBridgeWorker):
    def starts_with(self, token_ids, marker: str) -> bool:
        return self.bridge.tokenizer.decode(token_ids[:24], skip_special_tokens=True).startswith(marker.strip())

    def map_prompt(self, token_ids, *args, **kwargs):
        if self.starts_with(token_ids, FAULT_MARKER):
            raise RuntimeError("injected map failure")
        return super().map_prompt(token_ids, *args, **kwargs)


class FaultyConnector(KVBridgeConnector):
    worker_class = FaultyWorker


ONE_WORKER_MARKER = "# FAULT ON ONE WORKER\n"


class OneWorkerFaultyWorker(FaultyWorker):
    """Fails prompts that start with ONE_WORKER_MARKER on tensor-parallel rank 1 only: the other worker maps them."""

    def map_prompt(self, token_ids, *args, **kwargs):
        from vllm.distributed import get_tensor_model_parallel_rank

        if self.starts_with(token_ids, ONE_WORKER_MARKER) and get_tensor_model_parallel_rank() == 1:
            raise RuntimeError("injected map failure on worker 1")
        return super().map_prompt(token_ids, *args, **kwargs)


class OneWorkerFaultyConnector(FaultyConnector):
    worker_class = OneWorkerFaultyWorker
