"""Test connectors: a prefill connector whose every hook does nothing, for tests that override one."""

from __future__ import annotations

from pdserve.engine.kv_connector import PrefillConnector


class NoOpPrefillConnector(PrefillConnector):
    """Every PrefillConnector hook a no-op: subclass it and override the hook a test injects into."""

    def register_kv_cache(self, spec) -> None:
        pass

    def on_schedule(self, sched, block_ids) -> None:
        pass

    def on_layer_done(self, layer: int) -> None:
        pass

    def on_prefill_done(self, done) -> None:
        pass
