"""Engine core: the continuous-batching engine every node runs (E1-E21).

`llm_engine.LLMEngine` (schedule -> run -> update), `engine_thread.EngineThread` (the thread that
drives it for asyncio servers), `kv_connector` (the typed seam a KV transfer plugs into), the
request state, configs, scheduler/, cache/ (block pool, block tables, the KV pool's memory) and
sampling/. May import pdserve.model and pdserve.kernels; never fabric, kv_messenger, the wire
package, the router, the nodes, pdserve.serving or pdserve.tools (tests/unit/test_import_boundaries.py).
"""
