"""A kvbridge connector whose map fails for prompts that start with FAULT_MARKER (the serving tests' injected
failure: every other request goes through the real connector unchanged). Loaded by the engine from this folder."""

from kvbridge.serving.connector import KVBridgeConnector

FAULT_MARKER = "# FAULT INJECTED HERE\n"


class FaultyConnector(KVBridgeConnector):
    def map_prompt(self, token_ids, *args, **kwargs):
        if self._bridge.tokenizer.decode(token_ids[:24], skip_special_tokens=True).startswith(FAULT_MARKER.strip()):
            raise RuntimeError("injected map failure")
        return super().map_prompt(token_ids, *args, **kwargs)


ONE_WORKER_MARKER = "# FAULT ON ONE WORKER\n"


class OneWorkerFaultyConnector(FaultyConnector):
    """Fails prompts that start with ONE_WORKER_MARKER on tensor-parallel rank 1 only: the other worker maps them."""

    def map_prompt(self, token_ids, *args, **kwargs):
        from vllm.distributed import get_tensor_model_parallel_rank

        text = self._bridge.tokenizer.decode(token_ids[:24], skip_special_tokens=True)
        if text.startswith(ONE_WORKER_MARKER.strip()) and get_tensor_model_parallel_rank() == 1:
            raise RuntimeError("injected map failure on worker 1")
        return super().map_prompt(token_ids, *args, **kwargs)
