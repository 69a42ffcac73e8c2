"""The S3 stand-in of docker-compose.local.yml: the local stack's own Ceph (mon, OSD, radosgw) with the
S3 keys of .env, radosgw listening on the compose network. It stays in the foreground and exits when a
daemon does, so that compose's restart policy starts it again on the same durable store."""

import os
import signal
import sys
import time
from pathlib import Path

from pipeline.stack.ceph import start_ceph_s3
from pipeline.stack.process import pid_alive, stop

PORT = 9000


def main() -> int:
    keys = (os.environ["AWRL_S3_ACCESS_KEY"], os.environ["AWRL_S3_SECRET_KEY"])
    creds, procs = start_ceph_s3(Path("/data"), durable=True, rgw_port=PORT, bind="0.0.0.0", keys=keys)
    if creds.access_key != keys[0]:
        print("s3: /data holds a store made with other keys; remove the volume to use the keys of .env")
        return 1
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    print(f"s3: radosgw on :{PORT}, daemons {[p.pid for p in procs]}", flush=True)
    while not stopping and all(pid_alive(p) for p in procs):
        time.sleep(1)
    for p in reversed(procs):
        stop(p)
    if stopping:
        return 0
    print("s3: a daemon exited; see /data/log", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
