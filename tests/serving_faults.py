"""A kvbridge connector whose map fails for prompts that start with FAULT_MARKER (the serving tests' injected
failure: every other request goes through the real connector unchanged). Loaded by the engine from this folder."""

from kvbridge.serving.connector import KVBridgeConnector

FAULT_MARKER = "# FAULT INJECTED HERE\n"


class FaultyConnector(KVBridgeConnector):
    def map_prompt(self, token_ids, *args, **kwargs):
        if self._bridge.tokenizer.decode(token_ids[:24], skip_special_tokens=True).startswith(FAULT_MARKER.strip()):
            raise RuntimeError("injected map failure")
        return super().map_prompt(token_ids, *args, **kwargs)
