"""pdserve.serving.admission: the bounded gate the router and the decode nodes admit requests through (S8)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.serving.admission import AdmissionGate, ClientGate, ResourceExhaustedError
from pdserve_api.servers import status_for


def test_waiting_cap_counts_only_requests_that_have_not_started():
    gate = AdmissionGate("node n0", max_waiting=2, retry_after_s=2.5)
    a, b = gate.enter(), gate.enter()
    with pytest.raises(ResourceExhaustedError) as err:
        gate.enter()
    assert str(err.value) == "node n0 has 2 requests waiting for their first token, its cap (max 2); retry in 2.5 s"
    assert status_for(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_header == "3"
    a.started()
    a.started()  # idempotent
    c = gate.enter()  # a runs now: one waiting place is free
    assert (gate.inflight, gate.waiting, gate.refused) == (3, 2, 1)
    for t in (a, b, c, c):
        t.close()
    assert (gate.inflight, gate.waiting) == (0, 0)


def test_inflight_cap_and_the_context_manager_release():
    gate = AdmissionGate("the router", max_inflight=1)
    with gate.enter() as ticket:
        ticket.started()
        with pytest.raises(ResourceExhaustedError, match=r"the router has 1 requests in flight, its cap \(max 1\)"):
            gate.enter()
    with gate.enter():
        assert gate.inflight == 1
    assert gate.inflight == 0 and gate.waiting == 0


def test_bad_caps_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"x: max_waiting must be an integer >= 1 \(or None: no cap\), got 0"):
        AdmissionGate("x", max_waiting=0)
    with pytest.raises(ValueError, match="retry_after_s must be > 0"):
        AdmissionGate("x", retry_after_s=0)
    assert AdmissionGate("x").enter().waiting  # no caps: never refuses


def test_client_gate_caps_each_client_alone_and_forgets_idle_clients():
    gate = ClientGate("the router", max_per_client=2, retry_after_s=1.5)
    a1, a2, b1 = gate.enter("peer:10.0.0.1"), gate.enter("peer:10.0.0.1"), gate.enter("key:ab12")
    with pytest.raises(ResourceExhaustedError) as err:
        gate.enter("peer:10.0.0.1")
    assert str(err.value) == ("the router: client peer:10.0.0.1 has 2 requests in flight, the per-client cap "
                              "(max 2); retry in 1.5 s")
    assert err.value.retry_after_header == "2" and gate.refused == 1
    with gate.enter("key:ab12"):   # another client is not affected
        assert gate.inflight == {"peer:10.0.0.1": 2, "key:ab12": 2}
    for t in (a1, a1, a2, b1):   # close is idempotent
        t.close()
    assert gate.inflight == {}
    with gate.enter("peer:10.0.0.1"), gate.enter("peer:10.0.0.1"):
        pass
    assert gate.inflight == {}


def test_client_gate_refuses_bad_settings_naming_them():
    with pytest.raises(ValueError, match=r"x: max_per_client must be an integer >= 1, got 0"):
        ClientGate("x", max_per_client=0)
    with pytest.raises(ValueError, match=r"x: retry_after_s must be > 0, got 0"):
        ClientGate("x", max_per_client=1, retry_after_s=0)
