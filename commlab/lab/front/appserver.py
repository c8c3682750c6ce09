"""``commlab app``: the Streamlit server of the UI, started niced in a session of its own behind the
gatekeeper (commlab/app/server.py), over a runs directory; sign-in links and TLS when bound beyond loopback; the demo
run queued into an empty runs directory; and the stop on SIGINT, SIGTERM or SIGHUP of the server and of the
background sweeps it started. The pages' helpers are commlab.lab.front.ui's."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from commlab import api
from commlab.lab.base.errors import LabError
from commlab.lab.base.paths import SOURCE, make_private
from commlab.room import accounts
from commlab.lab.front.ui import runs_dir
from commlab.lab.rundir import disturbance
from commlab.lab.rundir.store import RunStore
from commlab.lab.service.spawn import ENV as SPAWNER_ENV
from commlab.lab.service.spawn import Spawner, lower_priority

REPO = SOURCE
APP_ENTRY = REPO / "commlab" / "app" / "server.py"
"""Streamlit's app behind the gatekeeper (commlab/app/server.py)."""
DEMO_SPEC = Path(__file__).resolve().with_name("demo.yaml")
"""The demo run's spec, shipped in the package (examples/demo.yaml links to it), so a wheel has it too."""


def app_argv(port: int = 8501, host: Optional[str] = None, certfile: Optional[str] = None,
             keyfile: Optional[str] = None) -> List[str]:
    """The Streamlit server's command line (a list, never a shell string).

    Two of Streamlit's defaults cost the machine a run trains on most of the server's CPU while a page
    follows the run: a full ``gc.collect(2)`` after every script run, fragment reruns included
    (``runner.postScriptGC``; about a quarter of the server's samples in a py-spy profile), and a watcher polling
    the modification time of every source file the app imported (``server.fileWatcherType``; it only
    serves reloading the app when its code is edited). Both are off: with the Live run and a Results page
    open, the server's CPU fell from 4.6 s to 1.1 s per 20 s (docs/benchmarks/observer.md).

    ``global.developmentMode`` is pinned off: Streamlit turns it on when its own files are not under a
    ``site-packages`` folder (a ``pip install --target`` elsewhere, as on the GPU machine), and in that
    mode it refuses ``--server.port``.

    ``certfile``/``keyfile``: the teacher's TLS certificate and key (Streamlit's own SSL options); uploads
    are capped at UPLOAD_MB; beyond loopback an error shows its type only, never its traceback, and a websocket
    message is refused past MESSAGE_MB as it arrives."""
    argv = [sys.executable, "-m", "streamlit", "run", str(APP_ENTRY), "--global.developmentMode", "false",
            "--server.address", host or "127.0.0.1", "--server.port", str(int(port)),
            "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--client.toolbarMode", "minimal", "--server.maxUploadSize", str(UPLOAD_MB),
            "--runner.postScriptGC", "false", "--server.fileWatcherType", "none"]
    if certfile:
        argv += ["--server.sslCertFile", str(certfile), "--server.sslKeyFile", str(keyfile)]
    if not accounts.is_loopback(host or "127.0.0.1"):  # no traceback (server paths, code) reaches a viewer
        # and no page is driven over plain HTTP (Streamlit's agent API), past the pages one person may open
        # and no browser's message is held whole in the server's memory past MESSAGE_MB
        argv += ["--client.showErrorDetails", "type", "--server.enableAgentApi", "false",
                 "--server.maxMessageSize", str(MESSAGE_MB)]
    return argv


UPLOAD_MB = 2
"""The largest file a viewer may upload (a profile, checked again at 2 MiB as data); Streamlit's default is
200 MB, held in the server's memory."""

MESSAGE_MB = 32
"""The largest websocket message, either way, on an exposed lab. Streamlit closes a browser's connection whose
message is over 25 MB (``server.maxWidgetStateSize``), but only once the server has read it whole, up to
``server.maxMessageSize`` (200 MB by default): six sessions of one person each sending a 190 MB message raised the
server's memory from 349 MB to 1,452 MB; at 32 MB the same messages were refused as they arrived and it stayed at
349 MB. The largest message the lab's pages sent for a run of 44 MB of timelines was 153 KB (its Live page)."""


LOCAL_PROXY = "127.0.0.1,::1"
"""What ``commlab app --behind-proxy`` with no address trusts: a proxy on this machine."""
FORWARDED_ENV = "FORWARDED_ALLOW_IPS"
"""uvicorn's setting (it serves Streamlit's app) of the peers whose X-Forwarded-For names the client. Its default,
loopback, would let anyone behind a proxy on this machine choose their own address, and so get past the sign-in
limits per address (commlab/app/room/gatekeeper.py): the lab sets it, to nothing unless the teacher names a proxy."""


def trusted_proxies(behind_proxy: Optional[str]) -> str:
    """``--behind-proxy``'s value as uvicorn takes it: comma-separated IP addresses or networks (``10.0.0.0/8``),
    checked; "" (no forwarded address believed) for None."""
    if behind_proxy is None:
        return ""
    import ipaddress
    items = [a.strip() for a in str(behind_proxy).split(",") if a.strip()]
    if not items:
        raise LabError("--behind-proxy: give at least one address (the proxy's: an IP address or network such as "
                       "10.0.0.0/8), or the flag alone for a proxy on this machine")
    for a in items:
        try:
            ipaddress.ip_network(a) if "/" in a else ipaddress.ip_address(a)
        except ValueError:
            raise LabError(f"--behind-proxy: {a!r} is not an IP address or network; give the proxy's address, e.g. "
                           f"127.0.0.1 or 10.0.0.0/8 (a network without host bits)") from None
    return ",".join(items)


def server_env(root: Path, exposed: bool, behind_proxy: Optional[str] = None, base: Optional[dict] = None) -> dict:
    """The Streamlit server's environment (``base``: this process's): the runs directory, whether sign-in is
    required, where the lab's code is, and which proxies may name the client (``trusted_proxies``)."""
    base = dict(os.environ if base is None else base)
    return {**base, "COMMLAB_RUNS": str(root), accounts.ACCESS_ENV: "token" if exposed else "off",
            FORWARDED_ENV: trusted_proxies(behind_proxy),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH")) if p)}


def ensure_demo_run(runs) -> Optional[str]:
    """Queue the demo spec (DEMO_SPEC) when ``runs`` holds no run yet, so the UI has something to show."""
    if RunStore(runs).list():
        return None
    return api.run(str(DEMO_SPEC), wait=False, runs=runs).id


def sign_in_lines(root: Path, host: str, port: int, token: Optional[str] = None, tls: bool = False) -> str:
    """The links a teacher hands out (class token) and keeps (admin token: shown only when it is made,
    since runs/access.json keeps its hash), after setting the class token to ``token`` when given
    (commlab.room.accounts), and a warning when served without TLS."""
    import socket
    data = accounts.set_class_token(root, token) if token else accounts.load_access(root)
    where = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    scheme = "https" if tls else "http"
    lines = [f"sign-in required (bound to {host}): tokens in {accounts.access_path(root)}",
             f"  students: {scheme}://{where}:{port}/?token={data['class_token']}"]
    if "admin_token" in data:  # made just now: the only time it can be shown (the file keeps its hash)
        lines.append(f"  teacher:  {scheme}://{where}:{port}/?token={data['admin_token']} (shown once: keep it)")
    else:
        lines.append("  teacher:  the link printed when the admin token was made (only its hash is kept); "
                     "`commlab workshop rotate admin` prints a new one")
    if not tls:
        lines.append("WARNING: served without TLS: tokens, session cookies and pages cross the network in "
                     "the clear; on a network you do not trust, pass --certfile and --keyfile")
    return "\n".join(lines)


def app_main(port: int = 8501, runs: Optional[os.PathLike] = None, host: Optional[str] = None,
             demo: bool = True, out=sys.stderr, token: Optional[str] = None, certfile: Optional[str] = None,
             keyfile: Optional[str] = None, behind_proxy: Optional[str] = None) -> int:
    """``commlab app``: serve the UI on host:port (127.0.0.1 unless ``host``) over the runs
    directory ``runs`` (default $COMMLAB_RUNS or ./runs) until interrupted. With ``demo``,
    an empty runs directory gets the demo run queued first. Bound beyond loopback, every request
    needs a token (commlab.room.accounts; ``token`` sets the class token) and the links are printed.
    ``certfile``/``keyfile`` serve it over TLS. ``behind_proxy``: the addresses of a proxy in front (LOCAL_PROXY: on
    this machine), whose X-Forwarded-For then names the client; without it the socket's peer is the client.
    Returns 0 after a stop by signal, else Streamlit's exit status."""
    import importlib.util
    if not 1 <= int(port) <= 65535:
        raise LabError(f"--port: must be in 1..65535, got {port}")
    if bool(certfile) != bool(keyfile):
        raise LabError("--certfile, --keyfile: give both (the certificate and its private key) or neither")
    for flag, f in (("--certfile", certfile), ("--keyfile", keyfile)):
        if f and not os.access(f, os.R_OK):
            raise LabError(f"{flag}: cannot read {f}")
    trusted_proxies(behind_proxy)  # a bad address is named before anything starts
    if behind_proxy is not None and accounts.is_loopback(host or "127.0.0.1"):
        raise LabError("--behind-proxy: only for a server bound beyond loopback (--host); on 127.0.0.1 there is "
                       "no sign-in, so no address to trust")
    missing = [m for m in ("streamlit", "plotly") if importlib.util.find_spec(m) is None]
    if missing:
        raise LabError(f"commlab app needs {' and '.join(missing)}: pip install 'commlab[app]'")
    root = Path(runs or runs_dir()).resolve()
    exposed = not accounts.is_loopback(host or "127.0.0.1")
    if make_private(root, narrow=exposed):  # every student's runs are below it: no other account reads them
        print(f"made {root} private to this account (mode 700): students' runs are below it", file=out, flush=True)
    if demo:
        rid = ensure_demo_run(root)
        if rid:
            print(f"no runs in {root} yet: queued the demo run {rid}", file=out, flush=True)
    env = server_env(root, exposed, behind_proxy)
    print(f"commlab UI on {'https' if certfile else 'http'}://{host or '127.0.0.1'}:{port}  (runs: {root}; "
          f"Ctrl-C stops it)", file=out, flush=True)
    if exposed:
        print(sign_in_lines(root, host, port, token, tls=bool(certfile)), file=out, flush=True)
    elif token:
        raise LabError("--token: only for a server bound beyond loopback (--host); on 127.0.0.1 there is no sign-in")
    # The server runs niced, in a session of its own (scheduling groups go by session: commlab/lab/service/spawn.py), so its
    # refreshes take the cores only when training ranks leave them idle; the runs and sweeps it starts are
    # started by this process instead, at normal priority. Signals reach the server from this process only.
    # SIGINT (Ctrl-C; a shell starts background jobs with it ignored, and children inherit that), SIGTERM
    # (kill, a service manager) and SIGHUP (the terminal closed) all stop the lab the same way: stop_app.
    old = {s: signal.signal(s, _raise_stop) for s in STOP_SIGNALS}
    server = None
    try:
        with Spawner(start=False) as spawner:
            try:
                env[SPAWNER_ENV] = spawner.address
                server = subprocess.Popen(app_argv(port, host, certfile, keyfile), env=env, cwd=str(REPO), start_new_session=True,
                                          preexec_fn=lower_priority)
                spawner.start()  # after the fork: no thread of ours runs while the server's preexec_fn does
                # the niced server watches runs without changing their timing: runs started here do not
                # count its CPU as disturbing them (commlab.lab.rundir.disturbance.observers)
                disturbance.register_observer(root, server.pid)
                code = server.wait()
                spawner.close()
                stopped = spawner.stop_owned("sweep")
                print(f"commlab UI: the server ended by itself (exit status {code}); stopped "
                      f"{len(stopped)} background sweep(s)", file=out, flush=True)
                return code
            except AppStop as e:
                for s in STOP_SIGNALS:  # a second signal while stopping must not cut the stop short
                    signal.signal(s, signal.SIG_IGN)
                if server is None:
                    print(f"commlab UI stopped on {e} before its server started", file=out, flush=True)
                else:
                    print(stop_app(server, spawner, e.signum, host or "127.0.0.1", int(port)), file=out, flush=True)
                return 0
    finally:
        if server is not None:
            disturbance.unregister_observer(root, server.pid)
        for s, h in old.items():
            signal.signal(s, h)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 10.0
"""How long the server and each sweep get to end after SIGTERM before they are killed."""


class AppStop(Exception):
    """Raised in ``commlab app`` by one of STOP_SIGNALS."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum, frame):
    raise AppStop(signum)


def stop_app(server: subprocess.Popen, spawner: Spawner, signum: int, host: str, port: int) -> str:
    """Stop what ``commlab app`` started for the UI: the Streamlit server (SIGTERM, which it handles by
    shutting down; SIGKILL after STOP_GRACE_S) and the background sweeps its spawner started. Runs are
    left to their supervisors. Returns the line that says what was stopped and whether the port is free."""
    how = "ended"
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            how = f"killed after {STOP_GRACE_S:g} s"
    spawner.close()  # no new process is started from here on
    sweeps = spawner.stop_owned("sweep", grace_s=STOP_GRACE_S)
    free = port_free(host, port)
    return (f"commlab UI stopped on {signal.Signals(signum).name}: server (pid {server.pid}) {how}, "
            f"{len(sweeps)} background sweep(s) stopped, port {port} "
            f"{'free' if free else 'STILL IN USE by another process'}; runs keep going under their supervisors")


def port_free(host: str, port: int, wait_s: float = 5.0) -> bool:
    """Whether ``port`` can be bound on ``host`` again (tried for up to ``wait_s``: sockets close as the
    server's process is reaped)."""
    import socket
    deadline = time.monotonic() + wait_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
        time.sleep(0.1)
