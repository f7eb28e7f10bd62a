"""Admission control as pure logic: each limit, each reason, tenants, classes, deadlines."""

import pytest
from prometheus_client import CollectorRegistry

from minserve.server.admission import (BATCH, INTERACTIVE, AdmissionConfig, AdmissionController,
                                       ClassLimits, Ticket, classify, tenant_of)


def ticket(tenant="t", cls=INTERACTIVE, prompt=10, max_tokens=10, deadline_s=None):
    return Ticket(tenant, cls, prompt, max_tokens, deadline_s)


def controller(registry=None, **kw):
    limits = kw.pop("limits", ClassLimits())
    kw.setdefault("interactive", limits)
    kw.setdefault("batch", limits)
    return AdmissionController(AdmissionConfig(**kw), registry)


def test_queue_full_requests_and_release_frees_the_slot():
    ac = controller(limits=ClassLimits(max_queued_requests=2))
    a, b, c = ticket(), ticket(), ticket()
    assert ac.try_admit(a).admitted and ac.try_admit(b).admitted
    d = ac.try_admit(c)
    assert (d.admitted, d.reason, d.status) == (False, "queue_full_requests", 429)
    assert d.retry_after_s >= 1
    ac.release(a)
    assert ac.try_admit(c).admitted
    assert ac.queued(INTERACTIVE) == (2, 40)


def test_started_requests_leave_the_waiting_room():
    ac = controller(limits=ClassLimits(max_queued_requests=1))
    a = ticket()
    assert ac.try_admit(a).admitted
    assert not ac.try_admit(ticket()).admitted
    ac.mark_started(a)                      # now bounded by the engine, not the waiting room
    assert ac.queued(INTERACTIVE) == (0, 0)
    assert ac.try_admit(ticket()).admitted
    ac.release(a)
    ac.release(a)                           # idempotent
    assert ac.inflight("t") == 1


def test_queue_full_tokens():
    ac = controller(limits=ClassLimits(max_queued_requests=None, max_queued_tokens=50))
    assert ac.try_admit(ticket(prompt=20, max_tokens=10)).admitted   # 30 queued
    d = ac.try_admit(ticket(prompt=15, max_tokens=10))               # 55 > 50
    assert (d.reason, d.status) == ("queue_full_tokens", 429)
    assert ac.try_admit(ticket(prompt=10, max_tokens=10)).admitted   # 50 fits exactly


def test_kv_budget_uses_bytes_per_token():
    ac = controller(limits=ClassLimits(max_queued_kv_bytes=1000), kv_bytes_per_token=10)
    assert ac.try_admit(ticket(prompt=40, max_tokens=20)).admitted   # 600 bytes
    d = ac.try_admit(ticket(prompt=30, max_tokens=20))               # +500 > 1000
    assert (d.reason, d.status) == ("kv_budget", 429)


def test_a_request_bigger_than_the_whole_budget_is_a_400_not_a_retry_loop():
    ac = controller(limits=ClassLimits(max_queued_tokens=50))
    d = ac.try_admit(ticket(prompt=40, max_tokens=20))
    assert (d.reason, d.status, d.retry_after_s) == ("request_too_large", 400, None)
    assert "50" in d.message


def test_tenant_quota_is_per_tenant_and_counts_running_requests():
    ac = controller(tenant_max_inflight=2)
    a1, a2 = ticket("a"), ticket("a")
    assert ac.try_admit(a1).admitted and ac.try_admit(a2).admitted
    ac.mark_started(a1)                     # running still counts against the quota
    d = ac.try_admit(ticket("a"))
    assert (d.reason, d.status) == ("tenant_quota", 429)
    assert ac.try_admit(ticket("b")).admitted
    ac.release(a1)
    assert ac.try_admit(ticket("a")).admitted


def test_priority_classes_have_separate_budgets():
    ac = AdmissionController(AdmissionConfig(interactive=ClassLimits(max_queued_requests=1),
                                             batch=ClassLimits(max_queued_requests=2)))
    assert ac.try_admit(ticket(cls=BATCH)).admitted
    assert ac.try_admit(ticket(cls=BATCH)).admitted
    assert ac.try_admit(ticket(cls=BATCH)).reason == "queue_full_requests"
    assert ac.try_admit(ticket(cls=INTERACTIVE)).admitted          # batch flood does not block it
    assert ac.try_admit(ticket(cls=INTERACTIVE)).reason == "queue_full_requests"
    assert ac.queued(BATCH)[0] == 2 and ac.queued(INTERACTIVE)[0] == 1


def test_deadline_model_and_shedding():
    ac = controller(parallel_slots=4, prior_prefill_s_per_token=0.001, prior_decode_s_per_step=0.01)
    t = ticket(prompt=100, max_tokens=50)
    # Empty queue: own prefill 100 * 1 ms + own decode 50 * 10 ms.
    assert ac.predict_s(t) == pytest.approx(0.1 + 0.5)
    assert ac.try_admit(ticket(prompt=100, max_tokens=50)).admitted
    # Queue ahead: its prefill (0.1 s) + its decode shared over 4 slots (0.5 / 4).
    assert ac.predict_s(t) == pytest.approx(0.1 + 0.125 + 0.6)
    d = ac.try_admit(ticket(prompt=100, max_tokens=50, deadline_s=0.8))
    assert (d.admitted, d.reason, d.status) == (False, "deadline", 429)
    assert d.predicted_s == pytest.approx(0.825) and d.retry_after_s >= 1
    assert ac.try_admit(ticket(prompt=100, max_tokens=50, deadline_s=0.9)).admitted


def test_observed_steps_move_the_rates():
    ac = controller(ewma_alpha=0.5, prior_prefill_s_per_token=0.001, prior_decode_s_per_step=0.1)
    ac.observe_step(0.02, num_prefill_tokens=0, num_decode_tokens=4)
    assert ac.decode_s_per_step == pytest.approx(0.06)             # halfway from 0.1 to 0.02
    assert ac.prefill_s_per_token == pytest.approx(0.001)          # no prefill in that step
    ac.observe_step(0.3, num_prefill_tokens=100, num_decode_tokens=0)
    assert ac.prefill_s_per_token == pytest.approx((0.001 + 0.003) / 2)
    assert ac.decode_s_per_step == pytest.approx(0.06)


def test_draining_rejects_with_503():
    ac = controller()
    ac.begin_drain()
    d = ac.try_admit(ticket())
    assert (d.admitted, d.reason, d.status) == (False, "draining", 503)
    assert d.retry_after_s is not None


def test_metrics_count_reasons_and_admissions():
    reg = CollectorRegistry()
    ac = controller(reg, limits=ClassLimits(max_queued_requests=1))
    ac.try_admit(ticket())
    ac.try_admit(ticket())
    ac.try_admit(ticket(cls=BATCH))
    get = reg.get_sample_value
    assert get("minserve:admission_admitted_total", {"priority_class": "interactive"}) == 1
    assert get("minserve:admission_admitted_total", {"priority_class": "batch"}) == 1
    assert get("minserve:admission_rejected_total",
               {"reason": "queue_full_requests", "priority_class": "interactive"}) == 1
    assert get("minserve:admission_rejected_total",
               {"reason": "deadline", "priority_class": "batch"}) == 0
    assert get("minserve:admission_queued_requests", {"priority_class": "interactive"}) == 1


def test_classify_tenant_class_and_deadline():
    t = classify({"authorization": "Bearer sk-1"}, user="bob", priority=0, deadline_ms=None,
                 prompt_tokens=3, max_tokens=4)
    assert t.tenant.startswith("key-") and "sk-1" not in t.tenant
    assert (t.priority_class, t.tokens, t.deadline_s) == (INTERACTIVE, 7, None)
    assert classify({}, user="bob", priority=5, deadline_ms=250, prompt_tokens=1,
                    max_tokens=1).priority_class == BATCH
    t = classify({"x-priority-class": "Batch", "x-deadline-ms": "1500"}, user=None, priority=-1,
                 deadline_ms=10, prompt_tokens=1, max_tokens=1)
    assert (t.priority_class, t.deadline_s, t.tenant) == (BATCH, 1.5, "anonymous")
    assert tenant_of(None, "bob") == "user-bob" and tenant_of("Basic xyz", None) == "anonymous"


@pytest.mark.parametrize("headers, deadline_ms, field", [
    ({"x-priority-class": "urgent"}, None, "x-priority-class"),
    ({"x-deadline-ms": "soon"}, None, "x-deadline-ms"),
    ({}, 0, "deadline_ms"),
    ({}, float("nan"), "deadline_ms"),
])
def test_classify_rejects_bad_values_naming_the_field(headers, deadline_ms, field):
    with pytest.raises(ValueError, match=field):
        classify(headers, user=None, priority=0, deadline_ms=deadline_ms, prompt_tokens=1, max_tokens=1)


def test_config_validation():
    with pytest.raises(ValueError, match="max_queued_requests"):
        ClassLimits(max_queued_requests=0)
    with pytest.raises(ValueError, match="tenant_max_inflight"):
        AdmissionConfig(tenant_max_inflight=0)
