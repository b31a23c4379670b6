"""Python clients for the inferd sockets.

Each client object owns one ZeroMQ socket and is meant for one thread (ZeroMQ
sockets are not thread-safe): give every thread its own client.

A ``tcp://`` endpoint of a daemon with ``security.curve`` needs ``curve=``: a
``ClientCurve`` with the daemon's public key and this client's keypair
(``ClientCurve.from_files``; docs/SECURITY.md).  A client the daemon refuses
(unknown key, not on an allow-list) gets no reply: ``RequestTimeout``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from time import monotonic
from typing import Any

import numpy as np
import zmq

from inferd_client.channel import RequestChannel, checked_timeout
from inferd_client.errors import (
    ClientError,
    InvalidArgument,
    MalformedReply,
    RemoteError,
    Unreachable,
)
from inferd_client.outputs import check_output_arrays, decode_outputs
from inferd_client.pending_regions import PendingRegions
from inferd_client.poll_window import PollWindow
from inferd_client.prepared import (
    FramesKey,
    FramesRequest,
    PreparedHeader,
    frames_key,
)
from inferd_client.region import SharedRegion
from inferd_client.replies import check_infer_reply, raise_if_error, result_of
from inferd_client.shm import (
    Layout,
    RegionChannel,
    SameCall,
    ShmRequest,
    encode_frames,
    encode_inputs,
    layout_of,
    placed_outputs,
)
from inferd_wire import protocol
from inferd_wire.curve import ClientCurve
from inferd_wire.endpoints import (
    DEFAULT_SEND_BUFFER_BYTES,
    default_endpoints,
    default_runtime_dir,
)
from inferd_wire.regions import shm_socket_path


def infer_request_header(
    model: str,
    descriptors: list[dict[str, Any]],
    placed: list[dict[str, Any]],
    deadline_ms: int | None,
    max_reply_frame_bytes: int | None = None,
) -> dict[str, Any]:
    """An infer request header without its id (each attempt's: ``PreparedHeader``).
    ``max_reply_frame_bytes``: the client's bound on a reply frame, told to the
    daemon, which answers ``RESOURCE_EXHAUSTED`` rather than send a longer one."""
    header: dict[str, Any] = {
        "v": protocol.PROTOCOL_VERSION,
        "op": "infer",
        "model": model,
        "inputs": descriptors,
    }
    if placed:
        header["outputs"] = placed
    if deadline_ms is not None:
        header["deadline_ms"] = deadline_ms
    if max_reply_frame_bytes is not None:
        header["max_reply_frame_bytes"] = max_reply_frame_bytes
    return header


#: Encoded shm and frames requests a client keeps, each (a camera loop needs one or two).
_MAX_PREPARED_REQUESTS = 64
#: The polling window before a shm reply is due, us (DESIGN.md 113; 0: none).
DEFAULT_REPLY_SPIN_US = 200


class InferenceClient:
    """Send tensors to a model and get tensors back.

    >>> with InferenceClient() as client:
    ...     outputs = client.infer("demo", {"image": image})

    Inputs and outputs can live in shared memory instead of travelling on the
    socket: ``shared_region`` makes a region and registers it with the daemon;
    arrays from ``region.array(...)`` are then sent by reference, and output
    arrays given in ``outputs=`` are written in place.

    ``send_buffer_bytes`` sizes the kernel's send buffer of an ``ipc://``
    connection (``SO_SNDBUF``, capped at ``net.core.wmem_max``; 0: the kernel's
    default), so that a tensor frame leaves in one write (DESIGN.md 116);
    ``send_buffer`` reports what the connection got.

    ``max_reply_frame_bytes`` bounds each frame of a reply on the infer socket:
    its header (up to 64 KiB: keep the bound above the largest header expected,
    ``describe``'s included) and each output tensor that comes back as a frame.
    Outputs the daemon writes into registered shared-memory regions are no
    frames and are not bounded by it.  Each infer request tells the daemon the
    bound, and the daemon answers a reply that would not fit with
    ``RESOURCE_EXHAUSTED`` (a ``RemoteError``; the request ran at most once,
    whatever ``retries`` says: not at all when the output's shape is static).
    A longer frame that comes all the same (a daemon older than the field) is
    refused by libzmq as its length arrives
    (``ZMQ_MAXMSGSIZE``), without taking it into memory; the call waiting for
    that reply raises ``ConnectionLost`` at once (after its ``retries``), and
    the client connects again for the next call.  None (the default): no
    bound, a reply of any size is taken.
    ``connections_lost`` counts the connections that ended once up (that, or a
    daemon that stopped or restarted).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 5.0,
        retries: int = 0,
        context: zmq.Context[Any] | None = None,
        curve: ClientCurve | None = None,
        shm_socket: str | None = None,
        reply_spin_us: int = DEFAULT_REPLY_SPIN_US,
        send_buffer_bytes: int = DEFAULT_SEND_BUFFER_BYTES,
        max_reply_frame_bytes: int | None = None,
    ) -> None:
        PollWindow(reply_spin_us, "reply_spin_us")  # fails here, not at the first region
        self._reply_spin_us = reply_spin_us
        self._channel = RequestChannel(
            endpoint or default_endpoints().infer,
            context,
            timeout,
            curve,
            send_buffer_bytes,
            max_reply_frame_bytes,
        )
        self._retries = retries
        self.last_reply: dict[str, Any] = {}
        #: Which socket the last infer call sent its request on, ``"infer"`` or
        #: ``"shm"``, set just before it is sent: also for a call that then raised
        #: (a timeout, a lost connection, an error reply), so it names where a
        #: late reply would come; a call refused before that leaves it ("" before
        #: any).  ``last_reply`` is the last reply that came.
        self.last_transport = ""
        self._shm_socket = shm_socket or str(
            shm_socket_path(self._channel.endpoint, default_runtime_dir())
        )
        self._shm: RegionChannel | None = None
        #: Registered regions by id; those ``shared_region`` made are closed with us.
        self._regions: dict[str, SharedRegion] = {}
        self._owned: list[SharedRegion] = []
        #: Regions that were registered on a shm connection the daemon closed (it
        #: restarted, say: it released them all): a call naming one of their arrays
        #: registers it again, and sends its arrays as frames while it cannot.
        self._released = PendingRegions()
        #: Replies discarded by shm connections that are gone.
        self._shm_discarded = 0
        #: Each model's output names, as its last reply on the infer socket listed
        #: them: a request placing all of them may go on the shm socket.
        self._output_names: dict[str, frozenset[str]] = {}
        #: Requests for the shm socket, encoded, by what they were made of; emptied
        #: whenever the registered regions change.
        self._shm_requests: dict[tuple[str, int | None, Layout, Layout], ShmRequest] = {}
        #: The last call that went on the shm socket, to see at once that the next
        #: passes the very same arrays; dropped with ``_shm_requests``.
        self._last_shm_call: SameCall | None = None
        #: Requests whose inputs all travel as frames, by what their header is
        #: made of (DESIGN.md 115); taken only while no region is registered.
        self._frames_requests: dict[FramesKey, FramesRequest] = {}

    @property
    def send_buffer(self) -> dict[str, Any]:
        """The kernel send buffer asked for each connection and what it got
        (``bytes``, ``sized``, ``capped``, ``effective_bytes``; DESIGN.md 116)."""
        return self._channel.send_buffer.status()

    @property
    def reply_spin(self) -> dict[str, int]:
        """The polling window before a shm reply is due (DESIGN.md 113): its width
        in us and its counters (replies caught in it, replies that came before it
        opened, windows that ended empty, the time spent polling)."""
        if self._shm is None:
            return PollWindow(self._reply_spin_us).status()
        return self._shm.spin.status()

    @property
    def discarded_replies(self) -> int:
        shm = self._shm.discarded_replies if self._shm is not None else 0
        return self._channel.discarded_replies + self._shm_discarded + shm

    @property
    def connections_lost(self) -> int:
        """Connections of the infer socket that ended once up: a reply frame over
        ``max_reply_frame_bytes``, or the daemon stopped or restarted."""
        return self._channel.connections_lost

    @property
    def shm_regions(self) -> dict[str, Any]:
        """The regions this client registered: ``registered`` (how many the daemon
        holds for it now), ``pending`` (each one the daemon let go, a restart say,
        and not registered again yet: ``label``, ``nbytes``, ``failures`` in a row,
        the last ``error``, ``retry_in_s``), ``failed_registrations`` (tries to
        register one again that failed, in all).  A call tries the due pending
        regions it names within its one timeout; after a try that got no
        connection or no answer, the others wait as long as that one without a
        try, so their ``failures`` and ``error`` stay as they were."""
        return {
            "registered": len(self._regions),
            "pending": self._released.status(),
            "failed_registrations": self._released.failed,
        }

    def shared_region(self, nbytes: int, *, label: str | None = None) -> SharedRegion:
        """A new region of at least ``nbytes``, registered with the daemon (and closed
        with this client)."""
        region = SharedRegion(nbytes, label=label)
        try:
            self.register_region(region)
        except BaseException:
            region.close()
            raise
        self._owned.append(region)
        return region

    def register_region(self, region: SharedRegion) -> str:
        """Register ``region`` (once per client); returns its id.  The daemon keeps it
        until ``unregister_region`` or until this client closes.  Should the daemon
        close the connection (a restart releases every region), the regions become
        pending: a call naming one's arrays registers it again, and sends them as
        frames while it cannot (``shm_regions``).  Only ``region`` is registered
        here, on a new connection if the daemon closed the old one: a pending
        region (``region`` itself aside, tried at once) never makes it fail."""
        if self._shm is not None and self._shm.hung_up():
            self._shm_closed()
        entry = self._released.find(region)
        if entry is None:
            return self._register(region)
        try:
            region_id = self._register(region)
        except ClientError as exc:
            self._released.failed_again(entry, exc)
            raise
        self._released.registered(entry)
        return region_id

    def _register(self, region: SharedRegion, timeout: float | None = None) -> str:
        for region_id, known in self._regions.items():
            if known is region:
                return region_id
        if not region.is_open:
            raise InvalidArgument("the shared region is closed: it cannot be registered")
        if self._shm is None:
            self._shm = RegionChannel(
                self._shm_socket,
                timeout=self._channel.timeout,
                reply_spin_us=self._reply_spin_us,
                next_id=self._channel.next_id,
            )
        try:
            region_id = self._shm.register(region, timeout=timeout)
        except Unreachable:
            self._shm_closed()
            raise
        except RemoteError:
            if self._shm.hung_up():  # refused at connect (a limit, the allow-list), closed
                self._shm_closed()
            raise
        self._regions[region_id] = region
        self._forget_shm_requests()
        return region_id

    def _shm_closed(self) -> None:
        """The shm connection failed or the daemon closed it, releasing every region
        registered on it: pending, each registered again, on a new one, by a call
        naming it.  Region ids are never reused, so a request naming the old ones
        would only be refused (``NOT_FOUND``) by a daemon that restarted."""
        for region in self._regions.values():
            self._released.add(region)
        self._regions.clear()
        self._forget_shm_requests()
        if self._shm is not None:
            self._shm_discarded += self._shm.discarded_replies
            self._shm.close()
            self._shm = None

    def _register_named(
        self,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, Any] | None,
        timeout: float | None,
    ) -> None:
        """Register again the pending regions this call names whose delay has passed
        (``shm_regions``), all within the call's timeout.  One that fails stays
        pending, its arrays sent as frames by this call: the daemon may refuse it
        for good (shm disabled, a smaller byte bound), and that is no reason to
        refuse a request it can serve.  A refusal of one region (a byte bound)
        lets the next be tried; a try that got no connection or no answer ends
        the call's tries, since the others would only wait as long again: they
        wait as long as that one (``PendingRegions.put_off``).  Those the timeout
        leaves no time for stay due, for the next call naming them."""
        arrays = [*inputs.values(), *(outputs or {}).values()]
        due = self._released.due(arrays)
        if not due:
            return
        if self._shm is not None and self._shm.hung_up():
            # The daemon closed it (a restart) while another region was registered
            # there: a try sent on it would fail, be counted, and be put off for
            # nothing.  Its regions are pending now too.
            self._shm_closed()
            due = self._released.due(arrays)
        wait = self._channel.timeout if timeout is None else checked_timeout(timeout)
        give_up_at = monotonic() + wait
        for tried, entry in enumerate(due):
            left = give_up_at - monotonic()
            if tried and left <= 0:
                return
            try:
                self._register(entry.region, max(left, 0.0))
            except ClientError as exc:
                self._released.failed_again(entry, exc)
                if not (isinstance(exc, RemoteError) and self._shm is not None):
                    self._released.put_off(due[tried + 1 :], entry)
                    return
            else:
                self._released.registered(entry)

    def unregister_region(self, region: SharedRegion) -> None:
        """Tell the daemon to let ``region`` go (once no request in flight uses it)."""
        self._released.remove(region)
        for region_id, known in list(self._regions.items()):
            if known is region and self._shm is not None:
                del self._regions[region_id]
                self._forget_shm_requests()
                try:
                    self._shm.unregister(region_id)
                except Unreachable:
                    self._shm_closed()  # a closed connection released it with the rest

    def _forget_shm_requests(self) -> None:
        self._shm_requests.clear()
        self._last_shm_call = None

    def infer(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        outputs: Mapping[str, np.ndarray] | None = None,
        timeout: float | None = None,
        deadline_ms: int | None = None,
        retries: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Run ``model`` on ``inputs``; returns the output arrays by name.

        Inputs that live in a registered region are sent by reference, the rest as
        frames.  A request with every input and every output in registered regions
        travels on the shm socket (one message each way, no ZeroMQ), once a reply
        on the infer socket (or ``describe``) has named the model's outputs, unless
        its header is over the socket's bound (``MAX_SHM_MESSAGE_BYTES``, 16 KiB).
        ``outputs`` maps output names to arrays to write them into: one in a
        registered region is written there by the daemon (no frame comes back),
        any other is filled from the reply's frame; the result holds those arrays.
        Each must be a writable numpy array of an output the model has
        (``InvalidArgument`` otherwise; a read-only one before anything is sent).
        Other outputs are read-only views of their frames.  Raises ``RemoteError``
        with the daemon's code, or ``RequestTimeout``.  The reply header (runtime
        label, fallback flag, latency, and ``late``: true when the result was
        finished after ``deadline_ms``) is kept in ``last_reply``.

        Memory in regions belongs to the daemon from the send until the reply:
        it reads the inputs and writes the placed outputs there whenever the
        request runs, and so also after this call raised ``RequestTimeout`` or
        ``ConnectionLost``, for every attempt ``retries`` sent (each may be
        queued, or running, when the call gives up).  ``unregister_region``,
        closing the region or the client stop none of it: the daemon keeps a
        region mapped while a request uses it, and the bytes are seen by
        whatever still maps them (arrays of it alive here, a camera service
        sharing an adopted memfd).  So after a timeout, do not reuse those
        arrays for anything that must not be overwritten until that request's
        late reply has come (it is discarded and counted in
        ``discarded_replies`` by a later call on the same socket), or use other
        arrays.  ``deadline_ms`` at or below the timeout makes the daemon answer
        ``DEADLINE_EXCEEDED`` without running a request that has not started
        by then, but it counts from the daemon's receipt (a request the daemon
        had not read yet can still start later) and never stops a run already
        started.

        A region the daemon let go (a restart) and that cannot be registered again
        (``shm_regions``) does not fail the call: its arrays travel as frames.
        The call's tries to register such regions again take at most its timeout
        in all, before the request's own wait.
        """
        attempts = self._retries if retries is None else retries
        if outputs:
            check_output_arrays(outputs)  # before anything is sent, wherever they live
        if self._released.entries:
            self._register_named(inputs, outputs, timeout)
        key = None
        if self._shm is not None and outputs:
            last = self._last_shm_call
            if last is not None and last.matches(model, deadline_ms, inputs, outputs):
                return self._infer_on_shm(model, last.request, outputs, timeout, attempts)
            in_layout, out_layout = layout_of(inputs), layout_of(outputs)
            if in_layout is not None and out_layout is not None:
                key = (model, deadline_ms, in_layout, out_layout)
                prepared = self._shm_requests.get(key)
                if prepared is not None and prepared.valid:
                    self._last_shm_call = SameCall(model, deadline_ms, inputs, outputs, prepared)
                    return self._infer_on_shm(model, prepared, outputs, timeout, attempts)
        if not self._regions:
            frames_call = frames_key(model, deadline_ms, inputs)
            if frames_call is not None:
                request = self._frames_requests.get(frames_call)
                if request is None:
                    request = self._prepare_frames(frames_call, inputs)
                frames = list(inputs.values())  # the arrays as they are (``frames_key``)
                return self._infer_on_frames(
                    model, request.header, frames, outputs, [], timeout, attempts, request
                )
        if self._shm is not None and self._shm.hung_up():
            # Not used since the daemon closed it (requests naming regions went on the
            # infer socket): their ids died with it.
            self._shm_closed()
            self._register_named(inputs, outputs, timeout)
        descriptors, frames = encode_inputs(dict(inputs), self._regions)
        placed = placed_outputs(dict(outputs), self._regions) if outputs else []
        header = infer_request_header(
            model, descriptors, placed, deadline_ms, self._channel.max_reply_frame_bytes
        )
        if (
            self._shm is not None
            and not frames
            and self._places_every_output(model, placed)
            and len(placed) == len(outputs or ())  # else one not placed is checked on the reply
        ):
            prepared = ShmRequest(header, placed, list(self._regions.values()))
            if not prepared.fits:  # the shm socket would refuse it, unread: the infer socket
                return self._infer_on_frames(
                    model, PreparedHeader(header), [], outputs, placed, timeout, attempts
                )
            assert outputs is not None  # placed is not empty
            if key is not None:
                if len(self._shm_requests) >= _MAX_PREPARED_REQUESTS:
                    self._forget_shm_requests()
                self._shm_requests[key] = prepared
                self._last_shm_call = SameCall(model, deadline_ms, inputs, outputs, prepared)
            return self._infer_on_shm(model, prepared, outputs, timeout, attempts)
        return self._infer_on_frames(
            model, PreparedHeader(header), frames, outputs, placed, timeout, attempts
        )

    def _prepare_frames(self, key: FramesKey, inputs: Mapping[str, np.ndarray]) -> FramesRequest:
        model, deadline_ms, _ = key
        descriptors, _ = encode_frames(inputs)
        bound = self._channel.max_reply_frame_bytes
        request = FramesRequest(infer_request_header(model, descriptors, [], deadline_ms, bound))
        if len(self._frames_requests) >= _MAX_PREPARED_REQUESTS:
            self._frames_requests.clear()
        self._frames_requests[key] = request
        return request

    def _infer_on_frames(
        self,
        model: str,
        header: PreparedHeader,
        frames: Sequence[Any],
        outputs: Mapping[str, np.ndarray] | None,
        placed: list[dict[str, Any]],
        timeout: float | None,
        retries: int,
        prepared: FramesRequest | None = None,
    ) -> dict[str, np.ndarray]:
        """A request on the infer socket; ``prepared``: the kept request it is, whose
        last reply's outputs may be reused (a one-off call parses its reply's)."""
        self.last_transport = "infer"
        reply, reply_frames = self._channel.request(
            header, frames, timeout=timeout, retries=retries
        )
        self.last_reply = reply
        raise_if_error(reply)
        check_infer_reply(reply, model)
        parsed = prepared.outputs_of(reply) if prepared is not None else None
        result = decode_outputs(reply, reply_frames, outputs, placed, parsed)
        self._output_names[model] = frozenset(result)
        return result

    def _infer_on_shm(
        self,
        model: str,
        request: ShmRequest,
        outputs: Mapping[str, np.ndarray],
        timeout: float | None,
        retries: int,
    ) -> dict[str, np.ndarray]:
        assert self._shm is not None
        self.last_transport = "shm"
        try:
            reply = self._shm.request(request, timeout=timeout, retries=retries)
        except Unreachable as exc:
            self._shm_closed()
            raise Unreachable(
                f"{exc}: it released this client's regions, which the next call naming "
                "them registers again"
            ) from None
        self.last_reply = reply
        if reply.get("ok") is False:
            self._output_names.pop(model, None)  # learn them again (a reloaded model)
            self._forget_shm_requests()
        raise_if_error(reply)
        check_infer_reply(reply, model)
        if request.written_as_placed(reply["outputs"]):  # written where asked, every one
            return {placed["name"]: outputs[placed["name"]] for placed in request.placed}
        return decode_outputs(reply, [], outputs, request.placed)

    def _places_every_output(self, model: str, placed: list[dict[str, Any]]) -> bool:
        names = self._output_names.get(model)
        return bool(placed) and names is not None and names <= {p["name"] for p in placed}

    def describe(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Models served on this socket with their input and output specs."""
        reply, _ = self._channel.request(
            PreparedHeader({"v": protocol.PROTOCOL_VERSION, "op": "describe"}), timeout=timeout
        )
        result = result_of(reply)
        models = result.get("models", [])
        if not isinstance(models, list):
            raise MalformedReply(f"describe: 'models' is not a list: {models!r:.200}")
        for model in models:
            if isinstance(model, dict) and model.get("outputs"):
                outputs = model["outputs"]
                if not isinstance(outputs, list) or not all(
                    isinstance(output, dict) and isinstance(output.get("name"), str)
                    for output in outputs
                ):
                    raise MalformedReply(f"describe: outputs without names: {outputs!r:.200}")
                names = frozenset(output["name"] for output in outputs)
                self._output_names[str(model.get("name"))] = names
        return result

    def close(self) -> None:
        """Close the sockets; the daemon releases the regions registered here."""
        self._channel.close()
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self._regions.clear()
        self._released.clear()
        self._forget_shm_requests()
        for region in self._owned:
            region.close()
        self._owned.clear()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OperatorClient:
    """Operator operations on the control socket (``status``, ``health``, ...).

    A control reply is one header, never tensor frames: a reply frame over a
    header's bound (``protocol.MAX_HEADER_BYTES``, 64 KiB) ends the connection
    as its length arrives, unread (``ZMQ_MAXMSGSIZE``), the call raises
    ``ConnectionLost`` at once and the client connects again for the next.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = 5.0,
        context: zmq.Context[Any] | None = None,
        curve: ClientCurve | None = None,
    ) -> None:
        # Small messages: the kernel's default send buffer takes each in one write.
        self._channel = RequestChannel(
            endpoint or default_endpoints().control,
            context,
            timeout,
            curve,
            0,
            protocol.MAX_HEADER_BYTES,
        )

    def call(self, op: str, *, timeout: float | None = None, **arguments: Any) -> dict[str, Any]:
        header = {"v": protocol.PROTOCOL_VERSION, "op": op, **arguments}
        reply, _ = self._channel.request(PreparedHeader(header), timeout=timeout)
        return result_of(reply)

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def health(self) -> dict[str, Any]:
        return self.call("health")

    @property
    def connections_lost(self) -> int:
        """Connections of the control socket that ended once up (a reply over a
        header's bound, or the daemon stopped or restarted)."""
        return self._channel.connections_lost

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> OperatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
