"""Code that runs inside a vLLM engine: the connectors' settings, the connectors, the HTTP middleware, idle time.

vLLM loads :mod:`kvbridge.serving.engine.connector` and :mod:`kvbridge.serving.engine.producer` by module path
(:data:`kvbridge.serving.engine.config.CONNECTOR_MODULE`, ``PRODUCER_MODULE``).
"""
