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
    # Empty engine: own prefill 100 * 1 ms + own decode 50 * 10 ms.
    assert ac.predict_s(t) == pytest.approx(0.1 + 0.5)
    assert ac.try_admit(ticket(prompt=100, max_tokens=50)).admitted
    # One queued ahead: it takes one of 4 free seats, but its prompt (0.1 s) is computed first.
    assert ac.predict_s(t) == pytest.approx(0.1 + 0.6)
    d = ac.try_admit(ticket(prompt=100, max_tokens=50, deadline_s=0.65))
    assert (d.admitted, d.reason, d.status) == (False, "deadline", 429)
    assert d.predicted_s == pytest.approx(0.7) and d.retry_after_s >= 1
    assert ac.try_admit(ticket(prompt=100, max_tokens=50, deadline_s=0.75)).admitted


def test_deadline_counts_running_work_and_the_wait_for_a_seat():
    """Issue 8.6: with every seat busy, a small request waits for the earliest running one to end
    (the old model saw only the queue and admitted it; it was answered after 77 s)."""
    ac = controller(parallel_slots=2, prior_prefill_s_per_token=0.001, prior_decode_s_per_step=0.01)
    small = ticket(prompt=10, max_tokens=5, deadline_s=0.5)
    assert ac.predict_s(small) == pytest.approx(0.01 + 0.05)
    ac.observe_running([(0, 100), (50, 200)])      # seats free at 1.0 s and 0.05 + 2.0 s
    assert ac.predict_s(small) == pytest.approx(max(1.0, 0.05) + 0.06)
    d = ac.try_admit(small)
    assert (d.admitted, d.reason, d.status) == (False, "deadline", 429)
    assert "1060 ms" in d.message and d.retry_after_s == 1          # ceil(1.0 s until a seat frees)
    assert "running" not in d.message  # nothing about the work of others
    # A queued request ahead takes the first free seat (1.0 s) and holds it for 0.01 + 0.5 s.
    assert ac.try_admit(ticket(prompt=10, max_tokens=50)).admitted
    assert ac.predict_s(small) == pytest.approx(1.51 + 0.06)
    ac.observe_running([(0, 100)])                 # one seat free: the queued one takes it now,
    assert ac.predict_s(small) == pytest.approx(0.51 + 0.06)   # and frees it first (0.51 < 1.0 s)
    ac.observe_running([])
    assert ac.predict_s(small) == pytest.approx(0.01 + 0.06)   # two free seats: its prompt first
    assert ac.try_admit(ticket(prompt=10, max_tokens=5, deadline_s=0.5)).admitted


def test_deadline_preempted_work_queues_before_the_waiting_room():
    ac = controller(parallel_slots=1, prior_prefill_s_per_token=0.001, prior_decode_s_per_step=0.01)
    # One seat, held for 1.0 s; a preempted request (300 tokens to recompute, 10 to generate) next.
    ac.observe_running([(0, 100), (300, 10)])
    assert ac.predict_s(ticket(prompt=10, max_tokens=5)) == pytest.approx(1.0 + 0.3 + 0.1 + 0.06)


def test_deadline_counts_time_spent_before_admission():
    ac = controller(prior_prefill_s_per_token=0.001, prior_decode_s_per_step=0.01)
    t = ticket(prompt=10, max_tokens=5, deadline_s=0.1)         # predicted 0.06 s: fits alone
    t.waited_s = 0.05                                            # but tokenizing took 50 ms
    d = ac.try_admit(t)
    assert (d.admitted, d.reason) == (False, "deadline") and "50 ms spent" in d.message


def test_expired_deadlines_are_counted():
    reg = CollectorRegistry()
    ac = controller(reg)
    t = ticket(cls=BATCH, deadline_s=1.0)
    assert ac.try_admit(t).admitted
    ac.record_expired(t)
    ac.release(t)
    get = reg.get_sample_value
    assert get("minserve:admission_deadline_expired_total", {"priority_class": "batch"}) == 1
    assert get("minserve:admission_deadline_expired_total", {"priority_class": "interactive"}) == 0
    assert ac.queued(BATCH) == (0, 0)


def test_observed_steps_move_the_rates():
    ac = controller(ewma_alpha=0.5, prior_prefill_s_per_token=0.001, prior_decode_s_per_step=0.1)
    ac.observe_step(0.02, num_prefill_tokens=0, num_decode_tokens=4)
    assert ac.decode_s_per_step == pytest.approx(0.06)             # halfway from 0.1 to 0.02
    assert ac.prefill_s_per_token == pytest.approx(0.001)          # no prefill in that step
    ac.observe_step(0.3, num_prefill_tokens=100, num_decode_tokens=0)
    assert ac.prefill_s_per_token == pytest.approx((0.001 + 0.003) / 2)
    assert ac.decode_s_per_step == pytest.approx(0.06)
    assert ac.decode_tokens_per_step == 1.0                        # one token per request per step


def test_speculative_steps_count_tokens_gained_not_rows():
    """A verify step computes a decoding request's last token plus its proposals (all counted in
    num_decode_tokens) and brings it 1 + its accepted proposals: the model counts output tokens."""
    ac = controller(ewma_alpha=1.0, parallel_slots=4, prior_prefill_s_per_token=0.001,
                    prior_decode_s_per_step=0.1)
    # 4 requests verify 3 proposals each (16 rows); 8 proposals accepted: 3 tokens per request.
    ac.observe_step(0.06, num_prefill_tokens=0, num_decode_tokens=16, num_spec_tokens=12,
                    num_accepted_spec_tokens=8)
    assert ac.decode_s_per_step == pytest.approx(0.06)
    assert ac.decode_tokens_per_step == pytest.approx(3.0)
    assert ac.decode_s_per_token == pytest.approx(0.02)
    assert ac.predict_s(ticket(prompt=10, max_tokens=30)) == pytest.approx(0.01 + 30 * 0.02)
    ac.observe_running([(0, 60)] * 4)              # every seat busy for 60 tokens x 20 ms
    assert ac.predict_s(ticket(prompt=10, max_tokens=30)) == pytest.approx(1.2 + 0.01 + 0.6)
    # Prefill rows and verify rows share a mixed step's time alike.
    ac.observe_step(0.2, num_prefill_tokens=84, num_decode_tokens=16, num_spec_tokens=12,
                    num_accepted_spec_tokens=0)
    assert ac.prefill_s_per_token == pytest.approx(0.002)
    assert ac.decode_tokens_per_step == pytest.approx(1.0) and ac.decode_s_per_token == pytest.approx(0.2)


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
    ({"x-deadline-ms": "nan"}, None, "x-deadline-ms"),      # issue 8.6: was reported as deadline_ms
    ({"x-deadline-ms": "-5"}, 100, "x-deadline-ms"),
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
