"""Shared-memory regions on the client side: memory the daemon reads inputs from and
writes outputs into, so that no tensor byte crosses the socket.

``SharedRegion`` (``inferd_client.region``) owns a sealed memfd and its mapping
and hands out numpy arrays backed by it.  ``RegionChannel`` is the connection to
the daemon's ``shm.sock``: the daemon keeps a region mapped for as long as the
connection that registered it stays open, so closing the channel (or the
process ending, or being killed) releases every region it registered.  A
request whose tensors all live in registered regions also travels on it
(``RegionChannel.request``): one message each way, no ZeroMQ (DESIGN.md 104).
``InferenceClient`` owns one channel (``InferenceClient.shared_region``).
Neither is thread-safe: one per thread, like the client itself.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from inferd_client.channel import checked_timeout, wait_ms
from inferd_client.endpoint_trust import check_process, process_generation, trusted_endpoint
from inferd_client.errors import (
    ClientError,
    InvalidArgument,
    MalformedReply,
    RequestTimeout,
    Unreachable,
)
from inferd_client.poll_window import Arrivals, PollWindow
from inferd_client.prepared import ExactMatch, PreparedHeader
from inferd_client.region import SharedRegion
from inferd_client.replies import check_reply_id, raise_if_error
from inferd_wire import protocol
from inferd_wire.protocol import ProtocolError
from inferd_wire.regions import (
    MAX_SHM_MESSAGE_BYTES,
    RegionRef,
)


class RegionChannel:
    """The connection to the daemon's ``shm.sock`` (``SOCK_SEQPACKET``): regions'
    registrations, and requests whose tensors all live in them.

    Replies to ids this channel no longer waits for (a request that timed out)
    are discarded and counted, never returned for another request.  A message
    over ``MAX_SHM_MESSAGE_BYTES`` is never sent (``InvalidArgument``): every
    message sent is one the daemon reads whole, so an error reply without an id
    (a refusal at connect, or of a header over its ``bus.max_header_bytes``) is
    the answer of the message that waits now, never taken for another's."""

    def __init__(
        self,
        path: str,
        *,
        timeout: float = 5.0,
        reply_spin_us: int = 0,
        next_id: Callable[[], int] | None = None,
    ) -> None:
        """``next_id``: where every message's id comes from (the client's one counter,
        shared with its infer socket, so that no late reply is taken for another
        message's; by default a counter of this channel's own)."""
        spin = PollWindow(reply_spin_us, "reply_spin_us")  # fails before any connection
        timeout = checked_timeout(timeout)
        trusted_endpoint(f"ipc://{path}")  # the same rules as for the ipc sockets
        try:
            self._socket = socket.socket(
                socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC
            )
        except OSError as exc:  # EMFILE, ENOBUFS, a policy denying it: as a refused connect
            raise Unreachable(f"cannot make a socket for the shm socket {path}: {exc}") from None
        # Bounds connect(2) only; on a Unix socket whose listener's backlog is full
        # Python's timed connect fails EAGAIN at once, so it never waits.
        self._socket.settimeout(timeout)
        try:
            self._socket.connect(path)
        except OSError as exc:
            self._socket.close()
            raise Unreachable(f"cannot connect to the shm socket {path}: {exc}") from None
        # Non-blocking, and waited on with poll(2) against a deadline only when a
        # call would block: a Python timeout polls before every send as well, and
        # the kernel's SO_RCVTIMEO starts again in full after each signal.
        self._socket.setblocking(False)
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(self._socket, select.POLLIN)
        self._writable.register(self._socket, select.POLLOUT)
        self._hangup = select.poll()  # POLLHUP and POLLERR are always polled for
        self._hangup.register(self._socket, select.POLLRDHUP)
        self._refused = False
        self.path = path
        self._timeout = timeout
        self._next_id = next_id or itertools.count(1).__next__
        self.discarded_replies = 0
        #: Registrations that timed out, by id, with the region each was for: the
        #: daemon may still make one, under an id only its late reply names.  That
        #: reply is adopted as the registration of the region ``register`` makes
        #: now, and unregisters any other (``_late``).
        self._unanswered_registrations: dict[int, weakref.ref[SharedRegion]] = {}
        #: The region ``register`` registers now, and the id of a late registration
        #: of it read meanwhile (``_late``).
        self._registering: SharedRegion | None = None
        self._adopted: str | None = None
        #: The polling window before an infer reply is due (``reply_spin``).
        self.spin = spin
        self._generation = process_generation()

    def register(self, region: SharedRegion, *, timeout: float | None = None) -> str:
        """Hand ``region``'s memfd to the daemon; returns the region id.  ``timeout``:
        the most seconds to wait for the answer (None: the channel's).

        A registration of ``region`` that timed out on this connection and that
        the daemon made late is this one: its late reply, read first without
        waiting, names the id, and nothing is sent.  Sent again, the region
        would be held twice, its second copy counted against the daemon's bounds
        and refused for the first's bytes.  One that comes while this waits is
        taken too: over this one's refusal or timeout, or in place of a copy."""
        wait = self._timeout if timeout is None else checked_timeout(timeout)
        self._registering = region  # ``_adopted`` is None outside ``register``
        try:
            if self._unanswered_registrations:
                self._read_queued(time.monotonic() + wait)
                if self._adopted is not None:
                    return self._adopted
            header: dict[str, Any] = {"op": "register"}
            if region.label is not None:
                header["label"] = region.label
            try:
                result = self._call(header, [region.fd], wait, region)
            except Unreachable:
                raise  # the connection is gone, and all it registered
            except ClientError:
                # The late one came while this waited: the region is registered.
                if self._adopted is None or self.hung_up():
                    raise
                return self._adopted
            region_id = result.get("region")
            if not isinstance(region_id, str):
                raise MalformedReply(f"register reply has no region id: {result!r}")
            if self._adopted is not None:  # made twice after all: one copy goes
                self._release(region_id, time.monotonic() + wait)
                return self._adopted
            return region_id
        finally:
            self._registering, self._adopted = None, None

    def unregister(self, region_id: str) -> None:
        self._call({"op": "unregister", "region": region_id}, [])

    def request(
        self,
        request: ShmRequest,
        *,
        timeout: float | None = None,
        retries: int = 0,
    ) -> dict[str, Any]:
        """Send an infer request (each attempt under a fresh id) and return its reply
        header; on timeout resend up to ``retries`` times.  ``InvalidArgument``, and
        nothing sent, for one that does not fit a message (``ShmRequest.fits``)."""
        wait = self._timeout if timeout is None else checked_timeout(timeout)
        for _attempt in range(retries + 1):
            request_id = self._next_id()
            reply = self._exchange(request.encode(request_id), [], request_id, wait, request.timing)
            if reply is not None:
                return reply
        raise RequestTimeout(
            f"no reply from {self.path} within {wait:.3f}s after {retries + 1} attempt(s)"
        )

    def _call(
        self,
        header: dict[str, Any],
        fds: list[int],
        timeout: float | None = None,
        region: SharedRegion | None = None,
    ) -> dict[str, Any]:
        """A registration op (``region``'s, for a ``register``): its result, or
        RemoteError."""
        request_id, message = self._message(header)
        wait = self._timeout if timeout is None else checked_timeout(timeout)
        try:
            reply = self._exchange(message, fds, request_id, wait)
        except BaseException:
            # A wait that failed on another message (MalformedReply), or that a
            # signal handler's exception cut short: the daemon may still make it.
            if region is not None:
                self._unanswered_registrations[request_id] = weakref.ref(region)
            raise
        if reply is None:
            if region is not None:
                self._unanswered_registrations[request_id] = weakref.ref(region)
            raise RequestTimeout(f"no reply from {self.path}")
        if reply.get("id") is None:
            # Our registration messages are always readable: this is the refusal of
            # the connection at accept (a limit, the allow-list), which the daemon
            # closes once it is sent.
            self._refused = True
        raise_if_error(reply)  # RemoteError, or MalformedReply for neither ok nor an error
        result = reply.get("result")
        if not isinstance(result, dict):
            raise MalformedReply(f"reply has no result: {reply!r}")
        return result

    def _exchange(
        self,
        message: bytes,
        fds: list[int],
        request_id: int,
        wait: float,
        timing: Arrivals | None = None,
    ) -> dict[str, Any] | None:
        """Send one message and wait up to ``wait`` s for the reply to
        ``request_id`` (None: none came); replies to other ids are discarded.
        With ``timing`` (an infer request's), the reply is polled for around the
        time it is due (``reply_spin``)."""
        check_process(self._generation, "the client's shm connection")
        if len(message) > MAX_SHM_MESSAGE_BYTES:
            # The daemon could read neither it nor its id: its refusal would carry none.
            raise InvalidArgument(
                f"a message of {len(message)} bytes cannot go on the shm socket, whose "
                f"messages hold at most {MAX_SHM_MESSAGE_BYTES} bytes"
            )
        give_up_at = time.monotonic() + wait
        try:
            try:
                if not self._send(message, fds, give_up_at):
                    return None
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused at connect (shm.max_connections): the refusal is queued for us
            sent_ns = time.monotonic_ns()
            ready = timing is not None and bool(
                self.spin.wait((self._socket.fileno(),), timing, sent_ns, int(give_up_at * 1e9))
            )
            while True:
                data = self._receive(give_up_at, ready)
                ready = False
                if data is None:
                    return None
                if not data:
                    raise Unreachable(f"the daemon closed the shm socket {self.path}")
                reply = _reply_of(data)
                reply_id = reply.get("id")
                if reply_id == request_id:
                    if timing is not None:
                        timing.observed(time.monotonic_ns() - sent_ns, self.spin.width_ns)
                    return reply
                if reply_id is None:  # an error (``check_reply_id``): see the class
                    return reply
                self._late(reply_id, reply, give_up_at)
        except OSError as exc:
            raise Unreachable(f"the shm socket {self.path} failed: {exc}") from None

    def _read_queued(self, give_up_at: float) -> None:
        """Read the replies already here, without waiting (``register``): a late
        registration's is adopted or its region unregistered (``_late``) before
        anything else is sent, so the daemon never holds a region twice."""
        try:
            while self._readable.poll(0):
                data = self._receive(0.0, ready=True)  # 0.0: long past, so never waits
                if data is None:
                    return
                if not data:
                    raise Unreachable(f"the daemon closed the shm socket {self.path}")
                reply = _reply_of(data)
                reply_id = reply.get("id")
                if reply_id is None:  # an error of a message given up on: nobody waits
                    self.discarded_replies += 1
                    continue
                self._late(reply_id, reply, give_up_at)
        except OSError as exc:
            raise Unreachable(f"the shm socket {self.path} failed: {exc}") from None

    def _late(self, reply_id: int, reply: dict[str, Any], give_up_at: float) -> None:
        """A reply to an id no longer waited for.  A late registration (the daemon
        made one the caller was told had timed out) of the region ``register``
        registers now is adopted as its registration; any other's region is
        unregistered, since nobody knows its id but this reply.  Other replies are
        discarded and counted."""
        made_for = self._unanswered_registrations.pop(reply_id, None)
        result = reply.get("result")
        region_id = result.get("region") if isinstance(result, dict) else None
        if made_for is None or reply.get("ok") is not True or not isinstance(region_id, str):
            self.discarded_replies += 1
            return
        registering = self._registering
        if registering is not None and made_for() is registering and self._adopted is None:
            self._adopted = region_id
            return
        self.discarded_replies += 1
        self._release(region_id, give_up_at)

    def _message(self, header: dict[str, Any]) -> tuple[int, bytes]:
        """A registration op's id and message."""
        request_id = self._next_id()
        return request_id, protocol.pack(
            {"v": protocol.PROTOCOL_VERSION, "id": request_id, **header}
        )

    def _release(self, region_id: str, give_up_at: float) -> None:
        """Unregister ``region_id`` (a registration nobody else knows of), without
        waiting for the answer (discarded as any reply to an id no longer waited
        for): a reply awaited here could be the one the current exchange waits for."""
        _, message = self._message({"op": "unregister", "region": region_id})
        # Not sent (the daemon not reading, or gone): the connection's close
        # releases it, and the exchange sees a closed connection for itself.
        with contextlib.suppress(OSError):
            self._send(message, [], give_up_at)

    def _send(self, message: bytes, fds: list[int], give_up_at: float) -> bool:
        """Send one message; False when it could not go before ``give_up_at`` (the
        daemon does not read: a seqpacket message goes whole or not at all)."""
        while True:
            try:
                if fds:
                    socket.send_fds(self._socket, [message], fds)
                else:
                    self._socket.send(message)
                return True
            except BlockingIOError:
                if not _wait(self._writable, give_up_at):
                    return False

    def _receive(self, give_up_at: float, ready: bool = False) -> bytes | None:
        """The next message (b"": the daemon closed the connection); None when none
        came before ``give_up_at`` (``ready``: a poll just saw one waiting)."""
        while True:
            if not ready and not _wait(self._readable, give_up_at):
                return None
            ready = False
            try:
                return self._socket.recv(MAX_SHM_MESSAGE_BYTES)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                # Reported once by the kernel when the daemon closed the connection
                # with our message unread; what it sent before closing is still there.
                try:
                    return self._socket.recv(MAX_SHM_MESSAGE_BYTES)
                except OSError:
                    return b""

    def hung_up(self) -> bool:
        """Whether the daemon closed the connection (so released every region
        registered on it), or refused it at connect and closes it: a poll that
        does not wait, for a call that has not otherwise used the connection."""
        return self._refused or bool(self._hangup.poll(0))

    def close(self) -> None:
        """Close the connection: the daemon releases every region it registered."""
        self._socket.close()


def region_ref(regions: dict[str, SharedRegion], array: np.ndarray) -> RegionRef | None:
    """Where ``array`` lives among the registered ``regions`` (by id), if anywhere."""
    for region_id, region in regions.items():
        located = region.locate(array)
        if located is not None:
            return RegionRef(region_id, *located)
    return None


def wire_dtype(name: str, dtype: np.dtype[Any]) -> str:
    """``protocol.wire_dtype_name``; a dtype the wire has no name for is the caller's
    ``InvalidArgument``, not a protocol error."""
    try:
        return protocol.wire_dtype_name(name, dtype)
    except ProtocolError as exc:
        raise InvalidArgument(str(exc)) from None


def encode_frames(
    tensors: Mapping[str, np.ndarray],
) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """``protocol.encode_tensors``, refusing what cannot be sent as ``wire_dtype`` does."""
    try:
        return protocol.encode_tensors(tensors)
    except ProtocolError as exc:
        raise InvalidArgument(str(exc)) from None


def encode_inputs(
    inputs: dict[str, np.ndarray], regions: dict[str, SharedRegion]
) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Input descriptors and frames: an array that lives in a registered region is
    described by its range there and sends no frame; any other is a frame."""
    descriptors: list[dict[str, Any]] = []
    frames: list[np.ndarray] = []
    for name, value in inputs.items():
        array = np.asarray(value)
        ref = region_ref(regions, array) if regions else None
        if ref is None:
            described, framed = encode_frames({name: array})
            descriptors += described
            frames += framed
        else:
            dtype_name = wire_dtype(name, array.dtype)
            if array.dtype.byteorder == ">":
                raise InvalidArgument(f"input {name!r} is big-endian; regions hold little-endian")
            descriptors.append(
                {"name": name, "dtype": dtype_name, "shape": list(array.shape), **ref.as_wire()}
            )
    return descriptors, frames


def placed_outputs(
    outputs: dict[str, np.ndarray], regions: dict[str, SharedRegion]
) -> list[dict[str, Any]]:
    """Descriptors of the caller's output arrays that live in a registered region:
    the daemon writes those outputs there."""
    placed = []
    for name, array in outputs.items():
        ref = region_ref(regions, array) if regions else None
        if ref is not None:
            dtype_name = wire_dtype(name, array.dtype)
            if array.dtype.byteorder == ">":  # the daemon writes little-endian bytes
                raise InvalidArgument(f"output {name!r} is big-endian; regions hold little-endian")
            placed.append(
                {"name": name, "dtype": dtype_name, "shape": list(array.shape), **ref.as_wire()}
            )
    return placed


#: What a request's tensors are, as far as its encoding goes: each array's name,
#: address, shape, strides and dtype, in order.
Layout = tuple[tuple[str, int, tuple[int, ...], tuple[int, ...], str], ...]


def layout_of(arrays: Mapping[str, Any]) -> Layout | None:
    """The layout of ``arrays``, or None when one is not an ndarray."""
    layout = []
    for name, array in arrays.items():
        if not isinstance(array, np.ndarray):
            return None
        interface = array.__array_interface__
        layout.append(
            (name, interface["data"][0], array.shape, array.strides, interface["typestr"])
        )
    return tuple(layout)


class SameCall:
    """A call's model, deadline and arrays, held weakly with the layout each had,
    and the request encoded for them: ``matches`` tells at once that a camera
    loop passed the very same arrays again (an array's address never changes;
    its shape, strides and dtype are compared, since a caller may change them)."""

    def __init__(
        self,
        model: str,
        deadline_ms: int | None,
        inputs: Mapping[str, np.ndarray],
        outputs: Mapping[str, np.ndarray],
        request: ShmRequest,
    ) -> None:
        self._call = (model, deadline_ms, len(inputs))
        self._arrays = [
            (name, weakref.ref(array), array.shape, array.strides, array.dtype)
            for name, array in (*inputs.items(), *outputs.items())
        ]
        self.request = request

    def matches(
        self,
        model: str,
        deadline_ms: int | None,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, Any],
    ) -> bool:
        arrays = self._arrays
        if (model, deadline_ms, len(inputs)) != self._call or len(outputs) != len(arrays) - len(
            inputs
        ):
            return False
        for (name, array), (known, ref, shape, strides, dtype) in zip(
            (*inputs.items(), *outputs.items()), arrays, strict=True
        ):
            same = ref()
            if name != known or same is None or same is not array:
                return False
            if same.shape != shape or same.strides != strides or same.dtype != dtype:
                return False
        return self.request.valid


class ShmRequest:
    """An infer request for the shm socket, encoded once but for its id: a camera
    loop sends the same arrays of the same regions every time, and only the id
    changes (``PreparedHeader``)."""

    def __init__(
        self,
        header: Mapping[str, Any],
        placed: list[dict[str, Any]],
        regions: Sequence[SharedRegion] = (),
    ) -> None:
        self._header = PreparedHeader(header)
        #: The placed outputs' descriptors, as the reply should give them back.
        self.placed = placed
        #: Whether a reply's ``outputs`` are ``placed``, exactly (types included).
        self.written_as_placed = ExactMatch(placed).matches
        self._regions = tuple(regions)
        #: When its replies arrive (``reply_spin``).
        self.timing = Arrivals()
        #: Whether it fits one message of the shm socket whatever its id (else it
        #: must go on the infer socket, whose headers may be larger).
        self.fits = self._header.max_bytes <= MAX_SHM_MESSAGE_BYTES

    @property
    def valid(self) -> bool:
        """Whether every region it names is still open here (a closed one's address
        may now be another mapping's)."""
        return all(region.is_open for region in self._regions)

    def encode(self, request_id: int) -> bytes:
        return self._header.encode(request_id)


def _reply_of(data: bytes) -> dict[str, Any]:
    """A message of the shm socket, as a reply header with a checked id."""
    try:
        reply = protocol.unpack_header(data, MAX_SHM_MESSAGE_BYTES)
    except ProtocolError as exc:
        raise MalformedReply(str(exc)) from None
    check_reply_id(reply)  # ``True == 1``, and a list is no set member
    return reply


def _wait(poller: select.poll, give_up_at: float) -> bool:
    """Whether ``poller``'s socket became ready before ``give_up_at`` (monotonic)."""
    remaining = give_up_at - time.monotonic()
    return remaining > 0 and bool(poller.poll(wait_ms(remaining)))
