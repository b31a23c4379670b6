"""Who may use which socket, against a real daemon (docs/SECURITY.md).

As root, the multi-user part creates real users and groups (removed afterwards) and
runs clients as them in forked children (``setgroups``/``setresgid``/``setresuid``,
the way a login would give them): a *viewer* in the clients' group may infer and
read status but not operate; an *operator* (also in the operators' group) may, and
the FDR records the uid and pid the kernel gave, not the ``requested_by`` it
claimed; a user outside the clients' group cannot even open the sockets.  The tcp
part needs no root: a non-loopback endpoint without CURVE stops the daemon at
start, and with CURVE only allow-listed keys get through.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from inferd_client import (
    ClientCurve,
    ClientError,
    ConnectionRefused,
    EventSubscriber,
    InferenceClient,
    OperatorClient,
    RemoteError,
    RequestTimeout,
)
from inferd_wire.regions import shm_socket_path
from tests.conftest import (
    HANG_S,
    REPO,
    DaemonProcess,
    free_port,
    render_config,
    start_daemon,
    wait_until,
)
from tests.integration.test_schemas import assert_valid

pytestmark = pytest.mark.integration

IMAGE = np.zeros((1, 3, 224, 224), np.float32)
ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="creating users and groups and running clients as them needs root (CI runs as root)",
)


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Accounts:
    clients_group: str
    clients_gid: int
    ops_group: str
    viewer: Account
    operator: Account
    outsider: Account


@pytest.fixture(scope="module")
def accounts() -> Iterator[Accounts]:
    """Two groups and three users, created for this module and removed after it."""
    tag = secrets.token_hex(3)
    clients, ops = f"ifdc{tag}", f"ifdg{tag}"
    users = {
        role: f"ifd{letter}{tag}"
        for role, letter in (("viewer", "v"), ("operator", "p"), ("outsider", "x"))
    }
    created_groups: list[str] = []
    created_users: list[str] = []
    try:
        for group in (clients, ops):
            _run("groupadd", group)
            created_groups.append(group)
        member_of = {"viewer": clients, "operator": f"{clients},{ops}", "outsider": None}
        for role, user in users.items():
            extra = ["-G", member_of[role]] if member_of[role] else []
            _run("useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-U", *extra, user)
            created_users.append(user)

        def account(user: str) -> Account:
            entry = pwd.getpwnam(user)
            return Account(
                user, entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(user, entry.pw_gid))
            )

        yield Accounts(
            clients,
            grp.getgrnam(clients).gr_gid,
            ops,
            account(users["viewer"]),
            account(users["operator"]),
            account(users["outsider"]),
        )
    finally:
        for user in created_users:
            subprocess.run(["userdel", user], capture_output=True, timeout=60)
        for group in created_groups:
            subprocess.run(["groupdel", group], capture_output=True, timeout=60)


def run_as(account: Account, action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``action()`` in a forked child running as ``account`` (its groups, gid, uid);
    its result, or ``{"crashed": ...}``.  A fork, not a new interpreter: the test's
    interpreter may live where the account cannot read (e.g. under /root)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_end)
        try:
            os.setgroups(list(account.groups))
            os.setresgid(account.gid, account.gid, account.gid)
            os.setresuid(account.uid, account.uid, account.uid)
            result = {"pid": os.getpid(), **action()}
        except BaseException as exc:
            result = {"crashed": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(write_end, "w") as out:
            json.dump(result, out)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as source:
        text = source.read()
    os.waitpid(pid, 0)
    result: dict[str, Any] = json.loads(text)
    assert "crashed" not in result, result["crashed"]
    return result


def outcome(call: Callable[[], Any]) -> str:
    """``ok``, the error code of a refused request, ``refused`` for a connection
    the daemon refused at its handshake, or ``timeout``."""
    try:
        call()
    except RemoteError as exc:
        return exc.code
    except ConnectionRefused:
        return "refused"
    except RequestTimeout:
        return "timeout"
    return "ok"


@pytest.fixture(scope="module")
def shared(accounts: Accounts, model_dir: Path) -> Iterator[DaemonProcess]:
    """A daemon whose sockets belong to the clients' group, operators by group, and
    an events socket only operators may subscribe to."""
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    workdir.chmod(0o711)  # the accounts may pass through, not list
    (workdir / "run").mkdir(mode=0o750)
    os.chown(workdir / "run", 0, accounts.clients_gid)  # like systemd's RuntimeDirectory
    text = render_config(
        workdir,
        [{"name": "demo", "path": str(model_dir / "demo.onnx")}],
        security={
            "infer_group": accounts.clients_group,
            "control_group": accounts.clients_group,
            "events_group": accounts.clients_group,
            "events_allow": [f"group:{accounts.ops_group}"],
            "operators": [f"group:{accounts.ops_group}"],
        },
    )
    daemon = start_daemon(text, workdir)
    yield daemon
    daemon.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def _client_session(daemon: DaemonProcess, requested_by: str) -> Callable[[], dict[str, Any]]:
    def session() -> dict[str, Any]:
        context: zmq.Context[Any] = zmq.Context()
        try:
            with (
                OperatorClient(daemon.control, context=context, timeout=HANG_S) as operator,
                InferenceClient(daemon.infer, context=context, timeout=HANG_S) as client,
            ):
                state = operator.status()["daemon"]["state"]
                served = client.infer("demo", {"image": IMAGE})["descriptors"].shape
                switch = outcome(
                    lambda: operator.call(
                        "runtime.switch",
                        model="demo",
                        runtime="onnx_trt_ep",
                        requested_by=requested_by,
                    )
                )
                build = outcome(
                    lambda: operator.call("build.start", model="demo", builder="simulated")
                )
                cancel = outcome(lambda: operator.call("build.cancel", build_id="b1-000000"))
                try:
                    with EventSubscriber(daemon.events, context=context) as events:
                        events.wait_joined(2.0)
                    subscribed = "ok"
                except ClientError:
                    subscribed = "refused"
            return {
                "status": state,
                "served": list(served),
                "switch": switch,
                "build": build,
                "cancel": cancel,
                "events": subscribed,
            }
        finally:
            context.destroy(linger=0)

    return session


@ROOT_ONLY
def test_a_user_who_may_infer_may_not_operate(accounts: Accounts, shared: DaemonProcess) -> None:
    switches_before = len([r.payload for r in shared.fdr_records("runtime_switch")])
    with OperatorClient(shared.control) as root:
        builds_before = root.call("build.status")["builds"]
    viewer = run_as(accounts.viewer, _client_session(shared, "root"))
    assert viewer["status"] == "serving" and viewer["served"] == [1, 256, 28, 28]
    assert (viewer["switch"], viewer["build"], viewer["cancel"]) == ("PERMISSION_DENIED",) * 3
    assert viewer["events"] == "refused"  # security.events_allow: operators only
    # Nothing changed: no switch was recorded, no build started.
    assert len([r.payload for r in shared.fdr_records("runtime_switch")]) == switches_before
    with OperatorClient(shared.control) as root:
        assert root.call("build.status")["builds"] == builds_before
        status = root.status()
    assert_valid("status_reply.json#/$defs/ok", {"v": 1, "id": 1, "ok": True, "result": status})
    assert status["security"]["permission_denied"] >= 3
    assert status["security"]["sockets"]["events"]["connections_refused"] >= 1
    assert status["security"]["sockets"]["control"]["group"] == accounts.clients_group
    denied = [line for line in shared.log().splitlines() if "permission_denied" in line]
    assert any(f"'uid': {accounts.viewer.uid}" in line for line in denied)


@ROOT_ONLY
def test_the_fdr_records_who_the_kernel_says_operated(
    accounts: Accounts, shared: DaemonProcess
) -> None:
    operator = run_as(accounts.operator, _client_session(shared, "root"))
    assert (operator["switch"], operator["build"], operator["events"]) == ("ok", "ok", "ok")
    assert operator["cancel"] == "NOT_FOUND"  # it may cancel; that build does not exist
    switch = [r.payload for r in shared.fdr_records("runtime_switch")][-1]
    assert switch["requested_by"] == "root"  # what the client claimed ...
    assert switch["peer"] == {  # ... next to who it was
        "transport": "ipc",
        "uid": accounts.operator.uid,
        "gid": accounts.operator.gid,
        "pid": operator["pid"],
        "user": accounts.operator.name,
        "curve_key": None,
        "address": None,
        "operator": True,
    }
    with OperatorClient(shared.control) as root:
        (build,) = root.call("build.status")["builds"]
    assert build["peer"]["uid"] == accounts.operator.uid
    assert build["peer"]["pid"] == operator["pid"]
    records = wait_until(
        lambda: [r.payload for r in shared.fdr_records("engine_build")],
        message="the build's FDR record",
    )
    assert records[-1]["peer"]["uid"] == accounts.operator.uid


@ROOT_ONLY
def test_a_user_outside_the_sockets_group_cannot_connect(
    accounts: Accounts, shared: DaemonProcess
) -> None:
    shm_sock = str(shm_socket_path(shared.infer, Path("/nonexistent")))

    def connect() -> dict[str, Any]:
        results = {}
        paths = {
            name: getattr(shared, name).removeprefix("ipc://")
            for name in ("infer", "control", "events")
        }
        for name, path in {**paths, "shm": shm_sock}.items():
            kind = socket.SOCK_SEQPACKET if name == "shm" else socket.SOCK_STREAM
            probe = socket.socket(socket.AF_UNIX, kind)
            try:
                probe.connect(path)
                results[name] = "connected"
            except PermissionError:
                results[name] = "EACCES"
            finally:
                probe.close()
        return results

    result = run_as(accounts.outsider, connect)
    del result["pid"]
    assert result == {
        "infer": "EACCES",
        "control": "EACCES",
        "events": "EACCES",
        "shm": "EACCES",
    }
    for name in ("infer", "control", "events"):
        info = Path(getattr(shared, name).removeprefix("ipc://")).lstat()
        assert (info.st_gid, info.st_mode & 0o777) == (accounts.clients_gid, 0o660)
    # shm.sock serves infer requests: the infer socket's group (it kept the daemon's)
    info = Path(shm_sock).lstat()
    assert (info.st_gid, info.st_mode & 0o777) == (accounts.clients_gid, 0o660)


# -- tcp ---------------------------------------------------------------------------


def test_a_non_loopback_tcp_endpoint_without_curve_does_not_start(
    tmp_path: Path, demo_model: Path
) -> None:
    config = tmp_path / "inferd.toml"
    config.write_text(
        render_config(
            tmp_path,
            [{"name": "demo", "path": str(demo_model)}],
            bus={"control_endpoint": f"tcp://0.0.0.0:{free_port()}"},
        )
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli", "run", "--config", str(config)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _out, err = process.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.communicate()
        raise AssertionError("inferd started on tcp://0.0.0.0 without CURVE") from None
    assert process.returncode == 2
    assert "bus.control_endpoint: 'tcp://0.0.0.0:" in err
    assert "set security.curve = true" in err


def test_loopback_tcp_without_curve_serves_anonymous_peers_that_never_operate(
    tmp_path: Path, demo_model: Path
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    control = f"tcp://127.0.0.1:{free_port()}"
    text = render_config(
        workdir, [{"name": "demo", "path": str(demo_model)}], bus={"control_endpoint": control}
    )
    daemon = start_daemon(text, workdir, endpoints={"control": control})
    try:
        with OperatorClient(daemon.control) as anonymous:
            sockets = anonymous.status()["security"]["sockets"]
            switch = outcome(
                lambda: anonymous.call("runtime.switch", model="demo", runtime="onnx_trt_ep")
            )
        log = daemon.log()
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    assert sockets["control"]["mechanism"] == "NULL"
    assert switch == "PERMISSION_DENIED"  # not even root: a tcp peer has no verified uid
    assert "tcp_without_curve" in log


@dataclass(frozen=True)
class CurveDaemon:
    daemon: DaemonProcess
    server_key: str
    ground: ClientCurve
    viewer: ClientCurve


@pytest.fixture
def curve_daemon(tmp_path: Path, demo_model: Path) -> Iterator[CurveDaemon]:
    """Every socket on tcp:// with CURVE (infer on every interface); two client keys
    made with ``inferd keys``: ``ground`` (an operator) and ``viewer``."""
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    endpoints = {
        "infer": f"tcp://0.0.0.0:{free_port()}",
        "control": f"tcp://127.0.0.1:{free_port()}",
        "events": f"tcp://127.0.0.1:{free_port()}",
    }
    text = render_config(
        workdir,
        [{"name": "demo", "path": str(demo_model)}],
        bus={f"{name}_endpoint": value for name, value in endpoints.items()},
        security={"curve": True, "operators": ["key:ground"]},
    )
    (workdir / "inferd.toml").write_text(text)

    def keys(*args: str) -> str:
        command = [sys.executable, "-m", "inferd.cli", "keys", *args]
        done = subprocess.run(
            [*command, "--config", str(workdir / "inferd.toml")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout.strip()

    server_key = keys("init")
    for name in ("ground", "viewer"):
        keys("client", name, "--out", str(tmp_path))
    assert keys("show") == server_key
    ground = ClientCurve.from_files(server_key, tmp_path / "ground.key_secret")
    viewer = ClientCurve.from_files(server_key, tmp_path / "viewer.key_secret")
    connect = {**endpoints, "infer": endpoints["infer"].replace("0.0.0.0", "127.0.0.1")}
    daemon = start_daemon(text, workdir, endpoints=connect, curve=ground)
    yield CurveDaemon(daemon, server_key, ground, viewer)
    daemon.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def test_curve_admits_allow_listed_keys_and_operators_by_key(curve_daemon: CurveDaemon) -> None:
    daemon = curve_daemon.daemon
    with InferenceClient(daemon.infer, curve=curve_daemon.viewer) as client:
        assert client.infer("demo", {"image": IMAGE})["descriptors"].shape == (1, 256, 28, 28)
    with EventSubscriber(daemon.events, curve=curve_daemon.viewer) as events:
        events.wait_joined(HANG_S)
    with OperatorClient(daemon.control, curve=curve_daemon.viewer) as viewer:
        assert viewer.status()["security"]["sockets"]["infer"]["mechanism"] == "CURVE"
        assert outcome(
            lambda: viewer.call("runtime.switch", model="demo", runtime="onnx_trt_ep")
        ) == ("PERMISSION_DENIED")
    with OperatorClient(daemon.control, curve=curve_daemon.ground) as ground:
        ground.call("runtime.switch", model="demo", runtime="onnx_trt_ep", requested_by="x")
    peer = [r.payload for r in daemon.fdr_records("runtime_switch")][-1]["peer"]
    assert (peer["transport"], peer["curve_key"], peer["uid"]) == ("tcp", "ground", None)
    assert peer["address"] == "127.0.0.1"


def test_inferctl_connects_with_curve(curve_daemon: CurveDaemon, tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "inferd_client.cli",
        "--control-endpoint",
        curve_daemon.daemon.control,
        # Attached: a Z85 key may begin with "-", which argparse takes for an option.
        f"--curve-server-key={curve_daemon.server_key}",
        "--curve-cert",
        str(tmp_path / "viewer.key_secret"),
        "--json",
        "health",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "serving"
    half = subprocess.run(command[:5] + command[6:], cwd=REPO, capture_output=True, text=True)
    assert half.returncode == 2 and "needs both --curve-server-key and --curve-cert" in half.stdout


def test_curve_refuses_unknown_keys_and_plain_clients(curve_daemon: CurveDaemon) -> None:
    daemon = curve_daemon.daemon
    public, secret = zmq.curve_keypair()
    stranger = ClientCurve(curve_daemon.server_key, public.decode(), secret.decode())
    with OperatorClient(daemon.control, curve=stranger, timeout=1.0) as client:
        assert outcome(client.status) == "refused"  # the ZAP handler said no, at once
    with OperatorClient(daemon.control, curve=curve_daemon.ground) as ground:
        sockets = ground.status()["security"]["sockets"]
    assert sockets["control"]["connections_refused"] >= 1  # the ZAP handler said no
    with OperatorClient(daemon.control, timeout=1.0) as plain:
        assert outcome(plain.status) == "timeout"  # no CURVE: the handshake itself fails
    refused = [line for line in daemon.log().splitlines() if "peer_refused" in line]
    assert refused and "not in security.curve_clients_dir" in refused[0]


def test_an_ipv6_loopback_endpoint_binds_and_serves(tmp_path: Path, demo_model: Path) -> None:
    """``tcp://[::1]:PORT`` passes the config's checks; its sockets (the daemon's
    ROUTER and XPUB, the clients' DEALER and SUB) set ``ZMQ_IPV6``, without which
    libzmq refuses an IPv6 literal (the daemon once exited 1 at the bind)."""
    workdir = Path(tempfile.mkdtemp(prefix="ifd-"))
    control, events = (f"tcp://[::1]:{free_port()}" for _ in range(2))
    text = render_config(
        workdir,
        [{"name": "demo", "path": str(demo_model)}],
        bus={"control_endpoint": control, "events_endpoint": events},
    )
    daemon = start_daemon(text, workdir, endpoints={"control": control})
    try:
        with EventSubscriber(events) as subscriber:
            subscriber.wait_joined(HANG_S)  # a health event came over IPv6
        with OperatorClient(daemon.control) as anonymous:
            sockets = anonymous.status()["security"]["sockets"]
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    assert sockets["control"]["mechanism"] == "NULL"
    assert sockets["events"]["endpoint"].startswith("tcp://[::1]:")
