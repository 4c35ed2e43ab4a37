"""Tunables of the cluster, in one place.

Every timing is in seconds unless its name says otherwise. Changing a value here changes it for
the master, the workers and the tests alike; `cluster.yaml` overrides the ones that are per-cluster.
"""

from __future__ import annotations

#: Version of the wire protocol (docs/PROTOCOL.md). A peer speaking another version is refused.
PROTOCOL_VERSION = 1

#: Frames at least this large are sent without copying (pyzmq hands ZeroMQ the buffer itself);
#: below it a copy is cheaper than the bookkeeping of a zero-copy send.
ZERO_COPY_THRESHOLD = 64 * 1024

#: Largest header (frame 1) accepted, in bytes: a header carries names, shapes and small metadata.
MAX_HEADER_BYTES = 16 * 1024 * 1024

#: Largest message the master's REP socket accepts (ZMQ_MAXMSGSIZE, per frame), in bytes.
MAX_MESSAGE_BYTES = 2 * 1024**3

#: Most arrays one message may carry.
MAX_ARRAYS = 4096

#: Default ports of the master.
DEFAULT_PUB_PORT = 5555
DEFAULT_REP_PORT = 5556

#: How often the master announces itself on PUB (slow-joiner handshake, round/version beacon).
ANNOUNCE_INTERVAL = 0.2

#: Lazy Pirate: how long a worker waits for a reply before it closes, reopens and resends.
REQUEST_TIMEOUT = 10.0
#: Lazy Pirate: bytes per second a request is granted on top of REQUEST_TIMEOUT (a 100 MB
#: update waits 10 s + 5 s before it is resent).
MIN_THROUGHPUT = 20e6
#: Lazy Pirate: how many times a request is sent before the peer is declared unreachable.
REQUEST_RETRIES = 5

#: How often a worker's heartbeat thread pings the master.
HEARTBEAT_INTERVAL = 1.0
#: A worker not heard from for this long is taken for dead: dropped from the open round.
HEARTBEAT_TIMEOUT = 5.0

#: How long a restarted master announces itself before reopening its round, so that the
#: workers' SUB sockets have reconnected when the round's payload goes out.
RESUME_GRACE = 1.0

#: Largest share of a job's wall time the master spends writing checkpoints: a due checkpoint
#: is skipped while the last write took more than this share of the time since it ended (a
#: 0.4 MB model is still written every round, a 100 MB one every few rounds).
CHECKPOINT_BUDGET = 0.1

#: How long a worker waits for the first announcement before giving up.
JOIN_TIMEOUT = 120.0

#: Default longest time a round waits for uploads before aggregating what arrived.
ROUND_DEADLINE = 120.0

#: Default longest time the master waits at the end for workers' final reports. It waits only
#: for workers still alive (their heartbeats go on while they score and train their local-only
#: baselines, which can take long); a dead one is not waited for.
REPORT_TIMEOUT = 3600.0

#: Poll granularity of the master's and workers' event loops, in milliseconds.
POLL_INTERVAL_MS = 20

#: libzmq I/O threads of the master's context: the PUB fans every model out to each worker's
#: connection, so a second thread writes two of them at once (100 MB to 3 workers: -10 %).
MASTER_IO_THREADS = 2

#: ZeroMQ high-water marks: bound the queues so a slow peer cannot exhaust memory.
PUB_SNDHWM = 64
SUB_RCVHWM = 64
REP_RCVHWM = 64

#: Socket linger on close, in milliseconds: a closing socket drops unsent messages after this.
LINGER_MS = 1000
