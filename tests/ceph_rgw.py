"""A throwaway single-node Ceph RADOS Gateway on 127.0.0.1, for S3 tests.

One monitor, one in-memory OSD (memstore) and one radosgw, no systemd and no
manager, all files under one scratch folder. See ../shared/notes/s3-endpoints.md.
`.ci/run` installs the Debian packages (radosgw ceph-mon ceph-osd ceph-common).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

from tests.conftest import free_port

BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-authtool", "monmaptool", "radosgw-admin")


def ceph_unavailable_reason() -> str | None:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install radosgw ceph-mon ceph-osd)"
    if os.geteuid() != 0:
        return "the Ceph daemons need root"
    return None


class CephRGW:
    access_key = "KVCDNTESTACCESSKEY01"
    secret_key = "kvcdnTestSecretKey0123456789abcdefghijkl"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.mon_port = free_port()
        self.rgw_port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.rgw_port}"
        self.conf = self.root / "ceph.conf"
        self.env = {**os.environ, "CEPH_CONF": str(self.conf)}

    def _run(self, *args: str, timeout: float = 60) -> str:
        done = subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            said = done.stderr.strip() or self._log_tail(args)
            raise RuntimeError(f"{' '.join(args)} failed: {said[-800:]}")
        return done.stdout

    def _log_tail(self, args: tuple[str, ...]) -> str:
        """The daemons log to files, not stderr: the last lines of the one that failed."""
        name = {"ceph-mon": "mon.a", "ceph-osd": "osd.0", "radosgw": "client.rgw.a"}.get(args[0])
        log = self.root / "log" / f"{name}.log"
        if name is None or not log.exists():
            return "(no output)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-4:])

    def start(self) -> None:
        r = self.root
        fsid = str(uuid.uuid4())
        keyring = r / "keyring"
        (r / "mon").mkdir(parents=True)
        (r / "osd").mkdir()
        mon = f"v1:127.0.0.1:{self.mon_port}"
        self.conf.write_text(
            f"""[global]
fsid = {fsid}
mon host = {mon}
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon warn on pool no redundancy = false
# A throwaway monitor: it must start on a nearly full disk too (CI machines are
# shared); by default it refuses below 5% free space.
mon data avail crit = 0
mon data avail warn = 0
osd objectstore = memstore
memstore device bytes = 2147483648
osd crush chooseleaf type = 0
run dir = {r}/run
pid file = {r}/run/$name.pid
admin socket = {r}/run/$name.asok
log file = {r}/log/$name.log
keyring = {keyring}
ms bind ipv6 = false
[mon.a]
mon data = {r}/mon
[osd.0]
osd data = {r}/osd
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:{self.rgw_port}
rgw data = {r}/rgw
"""
        )
        (r / "run").mkdir()
        (r / "log").mkdir()
        (r / "rgw").mkdir()
        self._run(
            "ceph-authtool",
            "--create-keyring",
            str(keyring),
            "--gen-key",
            "-n",
            "mon.",
            "--cap",
            "mon",
            "allow *",
        )
        self._run(
            "ceph-authtool",
            str(keyring),
            "--gen-key",
            "-n",
            "client.admin",
            "--cap",
            "mon",
            "allow *",
            "--cap",
            "osd",
            "allow *",
            "--cap",
            "mds",
            "allow *",
        )
        self._run(
            "monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[{mon}]", str(r / "monmap")
        )
        self._run(
            "ceph-mon",
            "--mkfs",
            "-i",
            "a",
            "--monmap",
            str(r / "monmap"),
            "--keyring",
            str(keyring),
        )
        self._run("ceph-mon", "-i", "a")
        osd_uuid = str(uuid.uuid4())
        (r / "osd" / "fsid").write_text(osd_uuid + "\n")  # memstore needs it before mkfs
        self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid)
        self._run("ceph", "osd", "new", osd_uuid, "0")
        # The OSD sometimes exits at its first start while the monitor is still
        # settling (seen about once in three full test runs); a retry starts it.
        for attempt in range(3):
            try:
                self._run("ceph-osd", "-i", "0")
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                time.sleep(2)
        self._run("radosgw", "-n", "client.rgw.a")
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=2)
                break
            except urllib.error.HTTPError:
                break  # any HTTP answer means the gateway is up
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("radosgw did not answer within 90 s") from None
                time.sleep(0.5)
        self._run(
            "radosgw-admin",
            "user",
            "create",
            "--uid=kvcdn",
            "--display-name=kvcdn",
            f"--access-key={self.access_key}",
            f"--secret-key={self.secret_key}",
        )

    def stop(self) -> None:
        # Throwaway data: SIGKILL skips memstore's slow dump of its RAM image.
        for pid_file in (self.root / "run").glob("*.pid"):
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
            except (ValueError, OSError):
                pass
