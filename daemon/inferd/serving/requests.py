"""Admission of requests on the bus thread: the service's ``RequestHandler``.

Decides, before anything reaches a runtime, whether a request is served,
queued, superseded or refused, and owes every admitted request exactly one
reply: from the engine worker, or from here when its deadline passes, a newer
request supersedes it or the daemon shuts down.

Control ops come in two kinds (PROTOCOL.md, DESIGN.md 60): read-only ones anyone
admitted to the control socket may run, and operator ops, which change the
daemon's state and run only for a peer the ZAP handler verified as an operator;
the others are answered ``PERMISSION_DENIED`` before their arguments are read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog

from inferd.bus.codec import (
    Parsed,
    Request,
    check_descriptors,
    check_outputs,
    checked_inputs,
    input_views,
    model_of,
    output_views,
)
from inferd.bus.handler import Prepared, Reply
from inferd.bus.headers import InferHeader
from inferd.bus.internal_errors import unavailable_message
from inferd.bus.plans import AdmissionPlan, AdmissionPlans, plan_key
from inferd.bus.region_refs import NO_REFS, bind_regions, refs_of, uid_of
from inferd.bus.repeats import splits_at_id
from inferd.bus.request_options import deadline_ms_of, reply_frame_bound_of
from inferd.bus.zap import peer_of
from inferd.serving.prepared import PreparedRequest, PreparedRequests
from inferd.serving.reply_tensors import refuse_unfit_outputs
from inferd.serving.scheduler import (
    Job,
    QueueBytesFullError,
    QueueFullError,
    Scheduler,
    SchedulerClosedError,
)
from inferd.serving.slot import ModelSlot
from inferd.shm.leases import RequestRegions
from inferd.shm.regions import RegionTable
from inferd.types import EngineHandle, Peer
from inferd_wire import protocol
from inferd_wire.protocol import Code, ProtocolError

INFER_OPS = ("infer", "describe")

log = structlog.get_logger("inferd.requests")

#: A read-only control op: the header in, the result out.
ControlOp = Callable[[dict[str, Any]], dict[str, Any]]
#: An operator op: it also gets the verified peer (for the FDR and the logs).
OperatorOp = Callable[[dict[str, Any], Peer], dict[str, Any]]
Respond = Callable[[dict[str, Any] | ProtocolError], None]
#: An operator op whose reply comes later: it gets the header, the peer and a
#: ``respond`` callable taking the result (or a ProtocolError), callable from any thread.
DeferredOp = Callable[[dict[str, Any], Peer, Respond], None]


def ok_reply(request: Request, result: Mapping[str, Any]) -> Reply:
    return Reply(request.envelope, protocol.ok_header(request.request_id, result=result))


def job_error(job: Job, code: Code, message: str, finish: bool = True) -> Reply:
    """The reply to a job answered without running (its region leases go back, unless
    ``finish`` is False: a run still holds them, and gives them back when it ends)."""
    if finish:
        job.finish()
    return Reply(job.envelope, protocol.error_header(job.request_id, code, message))


def _answered_internal(slot: ModelSlot) -> None:
    """Count an admission that failed on a bug: the dispatcher answers it
    ``INTERNAL`` (``Dispatcher.answer``), and ``status`` must count every answer."""
    slot.stats.answered(str(Code.INTERNAL))


class RequestRouter:
    def __init__(
        self,
        slots: Mapping[str, ModelSlot],
        scheduler: Scheduler,
        control_ops: Mapping[str, ControlOp],
        operator_ops: Mapping[str, OperatorOp] | None = None,
        deferred_ops: Mapping[str, DeferredOp] | None = None,
        regions: RegionTable | None = None,
    ) -> None:
        self._slots = slots
        self._regions = regions
        self._scheduler = scheduler
        self._control_ops = control_ops
        self._operator_ops = operator_ops or {}
        self._deferred_ops = deferred_ops or {}
        #: Operator ops refused to peers without operator rights.
        self.permission_denied = 0
        self._owed: list[Reply] = []
        self._owed_lock = threading.Lock()
        self.accepting = True
        #: What admission concluded from repeated headers (``bus.plans``).
        self.plans = AdmissionPlans()
        #: Admissions kept for repeated requests on shm.sock (``serving.prepared``).
        self.prepared = PreparedRequests()

    # -- RequestHandler -------------------------------------------------
    def handle_infer(self, request: Request) -> Reply | None:
        if request.op == "describe":
            return ok_reply(request, {"models": [s.describe_io() for s in self._slots.values()]})
        if request.op != "infer":
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"unknown op {request.op!r} on the infer socket; it serves {list(INFER_OPS)}",
            )
        model = model_of(request.header)
        if not isinstance(model, str):
            raise ProtocolError(Code.INVALID_ARGUMENT, "'model' must be a string")
        slot = self._slots.get(model)
        if slot is None:
            raise ProtocolError(
                Code.NOT_FOUND, f"no model named {model!r}; served: {sorted(self._slots)}"
            )
        slot.stats.received()
        try:
            if not self.accepting:
                raise ProtocolError(Code.UNAVAILABLE, "the daemon is shutting down")
            every = request.local_uid is not None  # read on shm.sock (never by its route)
            key = plan_key(request, every) if self._regions is not None else None
            handle = slot.handle if slot.state == "serving" else None
            plan = self.plans.get(slot.name, key, handle)
            regions = bind_regions(request, self._regions, plan.refs if plan else None)
            try:
                self._admit(request, slot, regions, plan, key)
            except BaseException:
                if regions is not None:
                    regions.release()
                raise
        except ProtocolError as exc:
            slot.stats.answered(str(exc.code))
            raise
        except Exception:
            _answered_internal(slot)
            raise
        return None

    def admission_status(self) -> dict[str, int]:
        """Admissions that used a plan (``bus.plans``) or a prepared admission."""
        return {"admitted_on_plans": self.plans.used, "admitted_prepared": self.prepared.used}

    def prepared_for(self, route: bytes, repeat: bytes) -> PreparedRequest | None:
        """The admission prepared for a message of ``route`` whose bytes but for its
        id are ``repeat``, while it still holds: the daemon accepts requests and
        the slot serves the handle it was prepared for."""
        prepared = self.prepared.get(route, repeat)
        if prepared is None or not self.accepting:
            return None
        slot = prepared.slot
        if slot.state != "serving" or slot.handle is not prepared.handle:
            return None
        return prepared

    def admit_prepared(self, prepared: Prepared, request: Request) -> Reply | None:
        """Admit a repeat of the request ``prepared`` was made from: leased, range
        checked (or its frames' lengths checked), viewed and queued as that one
        was (refusals as ``handle_infer``'s)."""
        assert isinstance(prepared, PreparedRequest)  # what prepared_for hands out
        framed = prepared.placement is None
        if framed and len(request.tensors) != len(prepared.plan.inputs):
            return self.handle_infer(request)  # refused there, in the words it uses
        slot = prepared.slot
        slot.stats.received()
        self.prepared.used += 1
        try:
            regions = None if framed else self._lease_prepared(prepared, request)
            try:
                inputs = input_views(prepared.plan.inputs, request.tensors, regions)
                outputs = output_views(regions)
                nbytes = self._queued_bytes(request, slot)
                self._queue(
                    request,
                    slot,
                    (prepared.plan.inputs, inputs, outputs, prepared.handle),
                    regions,
                    (prepared.deadline_ms, reply_frame_bound_of(prepared.header)),
                    nbytes,
                )
            except BaseException:
                if regions is not None:
                    regions.release()
                raise
        except ProtocolError as exc:
            slot.stats.answered(str(exc.code))
            raise
        except Exception:
            _answered_internal(slot)
            raise
        return None

    def _lease_prepared(self, prepared: PreparedRequest, request: Request) -> RequestRegions:
        """The regions of a repeat, leased, with its tensors placed as the last time."""
        assert self._regions is not None and prepared.placement is not None  # it names regions
        # For the uid the full path checks, whatever the route kept it (bind_regions).
        regions = RequestRegions(self._regions, uid_of(request))
        if regions.lease_placement(prepared.placement):
            return regions
        # Another region under an id it leased: leased and range checked anew.
        rebound = bind_regions(request, self._regions, prepared.plan.refs)
        assert rebound is not None  # a plan names regions
        prepared.placement = rebound.placement()
        return rebound

    def _admit(
        self,
        request: Request,
        slot: ModelSlot,
        regions: RequestRegions | None,
        plan: AdmissionPlan | None,
        key: bytes | None,
    ) -> None:
        # The state before the handle: the worker sets the handle, then "serving"
        # (activation, a swap), so a handle read after "serving" is set; read the
        # other way round, a model becoming serving between the reads was refused.
        state = slot.state
        handle = slot.handle
        if plan is not None and plan.handle is not handle:
            plan = None  # the handle changed since the plan was looked up: check again
        outputs = None
        if state == "loading":
            # Loading or failing over: the request waits (up to its deadline)
            # and is validated against the IO spec once the model serves.
            parsed = check_descriptors(request.header, request.tensors, regions)
            inputs = None
        elif state == "serving" and handle is not None:
            # The checks in the order validate_inputs, validate_outputs make them.
            if plan is not None:  # an identical header passed them against this handle
                parsed = plan.inputs
                inputs = input_views(parsed, request.tensors, regions)
            else:
                parsed = checked_inputs(request.header, request.tensors, handle.inputs, regions)
                inputs = input_views(parsed, request.tensors, regions)
                every = request.local_uid is not None  # read on shm.sock
                check_outputs(regions, handle.outputs, every=every, inputs=(parsed, handle.inputs))
                if key is not None and regions is not None:
                    names = [name for name, _, _, _ in parsed]
                    plan = AdmissionPlan(handle, refs_of(regions, names), parsed)
                    self.plans.remember(slot.name, key, plan)
                elif regions is None and request.repeat is not None:
                    # Frames alone are never planned (frames differ per request),
                    # but a repeat of this very header can start from its checks.
                    plan = AdmissionPlan(handle, NO_REFS, parsed)
            outputs = output_views(regions)
        else:
            raise ProtocolError(Code.UNAVAILABLE, unavailable_message(slot.name, state))
        deadline_ms = deadline_ms_of(request.header, slot.config.default_deadline_ms)
        reply_frame_bound = reply_frame_bound_of(request.header)
        if reply_frame_bound is not None and handle is not None and state == "serving":
            refuse_unfit_outputs(handle.outputs, regions, reply_frame_bound)
        nbytes = self._queued_bytes(request, slot)
        # Prepared before it is queued: from then on the worker may run it and
        # release its regions at any moment.
        prepared = self._prepare(request, slot, regions, plan, deadline_ms)
        checked = (parsed, inputs, outputs, None if inputs is None else handle)
        self._queue(request, slot, checked, regions, (deadline_ms, reply_frame_bound), nbytes)
        if prepared is not None and request.repeat is not None:
            self.prepared.remember(request.envelope[0], request.repeat, prepared, request.local_uid)

    @staticmethod
    def _queued_bytes(request: Request, slot: ModelSlot) -> int:
        """The request's tensor frame bytes, within what the model's queue holds."""
        nbytes = sum(len(tensor) for tensor in request.tensors)
        if nbytes > slot.config.queue_max_bytes:
            raise ProtocolError(
                Code.INVALID_ARGUMENT,
                f"request holds {nbytes} tensor bytes; model {slot.name!r} queues at most "
                f"{slot.config.queue_max_bytes} bytes (queue_max_bytes)",
            )
        return nbytes

    def _prepare(
        self,
        request: Request,
        slot: ModelSlot,
        regions: RequestRegions | None,
        plan: AdmissionPlan | None,
        deadline_ms: int,
    ) -> PreparedRequest | None:
        """What admitting a repeat of ``request`` can start from, if it may have
        one: a typed request ending with its id, admitted on a plan (its inputs
        checked against the plan's handle) while its slot serves; where its
        region tensors were, or None when it has none (frames alone)."""
        header, repeat = request.header, request.repeat
        if repeat is None or plan is None or slot.state != "serving":
            return None
        if not isinstance(header, InferHeader) or not splits_at_id(repeat, header):
            return None
        placement = None if regions is None else regions.placement()
        return PreparedRequest(slot, plan.handle, header, plan, deadline_ms, placement)

    def _queue(
        self,
        request: Request,
        slot: ModelSlot,
        checked: tuple[
            list[Parsed], dict[str, Any] | None, dict[str, Any] | None, EngineHandle | None
        ],
        regions: RequestRegions | None,
        options: tuple[int, int | None],
        nbytes: int,
    ) -> None:
        """Queue the admitted request as a job; a job it supersedes is answered.
        ``checked``: its parsed inputs, its input and output views and the engine
        they were checked against (the last three None while its model loads);
        ``options``: its deadline in ms (0: none) and its reply frames' bound."""
        described, inputs, outputs, checked_against = checked
        deadline_ms, reply_frame_bound = options
        now_ns = time.monotonic_ns()
        assert request.request_id is not None  # check_request guarantees it
        job = Job(
            envelope=request.envelope,
            request_id=request.request_id,
            model=slot.name,
            inputs=inputs,
            received_ns=now_ns,
            deadline_ns=now_ns + deadline_ms * 1_000_000 if deadline_ms else None,
            frames=request.tensors,
            described=described,
            nbytes=nbytes,
            regions=regions,
            outputs=outputs,
            checked_against=checked_against,
            max_reply_frame_bytes=reply_frame_bound,
        )
        try:
            superseded = self._scheduler.submit(job)
        except QueueFullError:
            raise ProtocolError(
                Code.RESOURCE_EXHAUSTED,
                f"queue of model {slot.name!r} is full ({slot.config.queue_capacity} requests)",
            ) from None
        except QueueBytesFullError as exc:
            raise ProtocolError(
                Code.RESOURCE_EXHAUSTED,
                f"queue of model {slot.name!r} holds {exc.queued_bytes} bytes; this request's "
                f"{nbytes} would exceed its limit of {exc.max_bytes} bytes (queue_max_bytes)",
            ) from None
        except SchedulerClosedError:
            raise ProtocolError(Code.UNAVAILABLE, "the daemon is shutting down") from None
        if superseded is not None:
            slot.stats.answered(str(Code.CANCELLED))
            why = "superseded: a newer request from the same client arrived (queue_policy=latest)"
            self._owe([job_error(superseded, Code.CANCELLED, why)])

    def handle_control(self, request: Request) -> Reply | None:
        # The control socket's headers are always read as dicts (BusServer._serve).
        assert isinstance(request.header, dict)
        operation = self._control_ops.get(request.op)
        if operation is not None:
            return ok_reply(request, operation(request.header))
        if not self.accepting and request.op in (*self._deferred_ops, *self._operator_ops):
            # Stopping: a switch begun now would only be given up, a build cancelled.
            raise ProtocolError(
                Code.UNAVAILABLE, f"the daemon is shutting down; {request.op} was not run"
            )
        deferred = self._deferred_ops.get(request.op)
        if deferred is not None:
            deferred(request.header, self._operator(request), self._responder(request))
            return None
        operator_op = self._operator_ops.get(request.op)
        if operator_op is not None:
            return ok_reply(request, operator_op(request.header, self._operator(request)))
        known = sorted([*self._control_ops, *self._operator_ops, *self._deferred_ops])
        raise ProtocolError(
            Code.INVALID_ARGUMENT, f"unknown control op {request.op!r}; known: {known}"
        )

    def _operator(self, request: Request) -> Peer:
        """The request's verified peer when it has operator rights, else PERMISSION_DENIED."""
        peer = peer_of(request.header_frame)
        if peer is not None and peer.operator:
            return peer
        self.permission_denied += 1
        who = "this peer (its connection carries no verified identity)"
        if peer is not None:
            who = peer.describe()
        log.warning(
            "permission_denied", op=request.op, peer=None if peer is None else peer.as_record()
        )
        raise ProtocolError(
            Code.PERMISSION_DENIED,
            f"{request.op} changes the daemon's state and needs operator rights, which "
            f"{who} does not have (security.operators; docs/SECURITY.md); nothing was changed",
        )

    def _responder(self, request: Request) -> Callable[[dict[str, Any] | ProtocolError], None]:
        def respond(result: dict[str, Any] | ProtocolError) -> None:
            if isinstance(result, ProtocolError):
                header = protocol.error_header(request.request_id, result.code, result.message)
            else:
                header = protocol.ok_header(request.request_id, result=result)
            self._owe([Reply(request.envelope, header, socket="control")])

        return respond

    def due_replies(self, now_ns: int) -> list[Reply]:
        due: list[Reply] = []
        next_deadline = self._scheduler.next_deadline_ns()
        if next_deadline is not None and next_deadline <= now_ns:
            for job in self._scheduler.expire(now_ns):
                waited_us = (now_ns - job.received_ns) // 1000
                self._slots[job.model].stats.answered(str(Code.DEADLINE_EXCEEDED))
                due.append(
                    job_error(
                        job,
                        Code.DEADLINE_EXCEEDED,
                        f"deadline passed after {waited_us} us in the queue of model {job.model!r}",
                    )
                )
        if self._owed:
            with self._owed_lock:
                due += self._owed
                self._owed = []
        return due

    def next_wakeup_ns(self) -> int | None:
        if self._owed:
            return time.monotonic_ns()
        return self._scheduler.next_deadline_ns()

    # -- called from other threads -------------------------------------
    def fail(self, jobs: Iterable[Job], code: Code, message: str, finish: bool = True) -> None:
        """Answer jobs that will never run (e.g. at shutdown); sent by the bus thread."""
        replies = []
        for job in jobs:
            self._slots[job.model].stats.answered(str(code))
            replies.append(job_error(job, code, message, finish))
        self._owe(replies)

    def _owe(self, replies: list[Reply]) -> None:
        with self._owed_lock:
            self._owed += replies
