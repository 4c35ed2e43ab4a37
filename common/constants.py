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
#: A registration's header may carry a local vocabulary (a million words fit), so this is the
#: bound for it and for what the master sends; every other request gets MAX_REQUEST_HEADER_BYTES.
MAX_HEADER_BYTES = 16 * 1024 * 1024

#: Largest header of a request other than ``register`` (fetch, update, report, ping carry a few
#: hundred names and numbers): msgpack builds a 56-byte object from one byte, so a 16 MiB header
#: of empty lists would cost the master 1 GB.
MAX_REQUEST_HEADER_BYTES = 256 * 1024

#: Most lists and maps one header may build, whatever its size (the cap on msgpack's fan-out).
MAX_HEADER_CONTAINERS = 310_000  # a 300,000-word vocabulary registers in one header

#: Largest message the master's REP socket accepts, in bytes: every frame is bounded by it
#: before it is read (ZMQ_MAXMSGSIZE: the peer is cut off), and the whole message after it is
#: (libzmq bounds no message's number of frames: MEMORY_LIMIT_SHARE bounds what they hold).
#: ``max_message_mb`` in cluster.yaml overrides it for models larger than this.
MAX_MESSAGE_BYTES = 256 * 1024**2

#: The master's memory ceiling (master/memory.py), where ``memory_limit_mb`` is not set: its
#: memory at start plus this share of what the machine then has available. ZeroMQ holds every
#: frame of a request before the master can read it; past the ceiling the master drops its REP
#: connections and the requests queued on them.
MEMORY_LIMIT_SHARE = 0.5
#: Seconds between two reads of the master's resident memory while it waits on requests.
MEMORY_CHECK_INTERVAL = 0.05
#: Longest wait for a closed REP socket's queues to be freed (libzmq's own thread frees them).
MEMORY_SETTLE_S = 2.0

#: The lock a master holds in its output folder while it writes there (common/atomic.hold_lock):
#: a second master, or a `fedctl run` clearing what it takes for an earlier attempt's files, is
#: refused while one of a killed `fedctl run` still writes.
MASTER_LOCK = "master.lock"
#: Tries of common.atomic.hold_lock, LOCK_RETRY_S apart, before a lock held elsewhere refuses
#: it: `fedctl runs` holds a master's lock for a moment to see whether it is held.
LOCK_ATTEMPTS = 5
LOCK_RETRY_S = 0.02
#: The final reports a master has received, a line each as they come (a resumed master reads them).
REPORTS_FILE = "reports.jsonl"
#: The note `fedctl run` leaves in a failed run's folder (`<output>.failed`): why it failed.
FAILED_NOTE = "FAILED"
#: The suffix of the folder `fedctl run` writes a run into (`<output>.partial`), renamed to
#: `<output>` once every process has ended well.
STAGING_SUFFIX = ".partial"

#: Most arrays one message may carry.
MAX_ARRAYS = 1024
#: Arrays named so belong to the aggregation strategy (SCAFFOLD's control variates), not the
#: model: a round's payload and an update may carry some beside the model's.
STRATEGY_ARRAY_PREFIX = "strategy."
SCAFFOLD_CONTROL = STRATEGY_ARRAY_PREFIX + "c."  #: + a parameter's name: the server's c
SCAFFOLD_CHANGE = STRATEGY_ARRAY_PREFIX + "dc."  #: + a parameter's name: a worker's Δc_i

#: Default ports of the master.
DEFAULT_PUB_PORT = 5555
DEFAULT_REP_PORT = 5556

#: How often the master announces itself on PUB (slow-joiner handshake, round/version beacon).
ANNOUNCE_INTERVAL = 0.2
#: A round's start is also announced at once, so that a subscriber that lost the round's message
#: fetches it without waiting for the beacon, but not sooner than this after the last
#: announcement: rounds of a few milliseconds (a synchronous step's phases) would otherwise wake
#: every worker twice a round (5 % of the synchronous NTM steps, measured).
ANNOUNCE_MIN_GAP = 0.02

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
#: With the other updates in, a round waits this long after the last refusal of an update
#: from those still out before it closes without them (an honest worker whose update was
#: refused sends no other this round).
REFUSED_GRACE_S = 5.0

#: Default longest time the master waits at the end for workers' final reports. It waits only
#: for workers still alive (their heartbeats go on while they score and train their local-only
#: baselines, which can take long); a dead one is not waited for.
REPORT_TIMEOUT = 3600.0

#: Poll granularity of the master's and workers' event loops, in milliseconds.
POLL_INTERVAL_MS = 20

#: libzmq I/O threads of the master's context: the PUB fans every model out to each worker's
#: connection, so a second thread writes two of them at once (100 MB to 3 workers: -10 %).
MASTER_IO_THREADS = 2

#: Fair service: most requests the master answers before it looks at the open round again, so a
#: queue of requests from one flooding peer cannot hold a round that has everything it needs.
MAX_REQUESTS_PER_TURN = 32

#: Fair service: requests per second one identity may send beyond its burst (a worker sends a
#: ping a second, an update and a fetch a round; millisecond rounds of a tiny model stay under).
REQUEST_RATE = 500.0
#: Fair service: requests one identity may send at once before its rate applies.
REQUEST_BURST = 1000

#: An identity that registers again sooner than this after its last registration of over
#: LARGE_REGISTER_BYTES is refused (`busy`; a worker tries again every second for 10 s).
REGISTER_INTERVAL = 5.0
#: A registration header past this (a topic family's vocabulary; an MLP's is under 4 kB) is
#: decoded at most once per REGISTER_INTERVAL a key: one of 218 kB costs the master some 4 ms
#: to decode, and a flood of them from one key, under REQUEST_RATE, starved the others.
LARGE_REGISTER_BYTES = 16 * 1024
#: A registration repeated sooner than this after the last is logged at debug level and not
#: as a `register` event (a restarted process takes longer to come back).
REREGISTER_QUIET_S = 1.0
#: Registrations of one worker the master logs (and writes as `register` events) within
#: REGISTER_LOG_WINDOW_S; the rest are counted and logged at debug: a member that makes up a
#: new process token at every request would otherwise write two log lines and an event each.
REGISTER_LOG_LIMIT = 5
REGISTER_LOG_WINDOW_S = 60.0
#: Workers a cluster with no worker list admits (`fedctl bench` scales to 1,000): past it a
#: new name is refused, so that a peer making up names cannot grow the roster without bound.
MAX_UNLISTED_WORKERS = 10_000
#: Per-round log lines (master and workers): the first ROUND_LINES_BURST rounds each, then at
#: most one every ROUND_LINE_INTERVAL_S (the rest at debug level; metrics.jsonl has every
#: round). A synchronized step of 5 ms rounds wrote 180 lines a second to each process's log,
#: some 5 % of a worker's time.
ROUND_LINES_BURST = 20
ROUND_LINE_INTERVAL_S = 0.2
#: Refused CURVE handshakes (a key not admitted) the master logs at warning within
#: REGISTER_LOG_WINDOW_S, the rest at debug: anyone who reaches the port can make up keys.
DENIAL_LOG_LIMIT = 5
#: Handshakes a worker lets fail without a word from the master before it gives up: one
#: that fails with no reason is a master key that does not match the master's (the master
#: cannot decrypt the hello); a few allow for a master dying mid-handshake.
HANDSHAKE_FAILURES_TO_GIVE_UP = 3
#: A connection to the master's ports that has not finished its ZMTP (and CURVE) handshake
#: within this is closed (libzmq's default is 30 s): an outsider holding thousands of idle
#: TCP connections, no key needed, ran the master out of file descriptors and locked the
#: workers out. An honest handshake is a few hundred bytes.
HANDSHAKE_IVL_MS = 5000
#: Final reports of one worker the master keeps (a restarted worker reports again; a resent
#: one is the same report and not counted); more are acknowledged and not kept.
MAX_REPORTS_PER_WORKER = 3

#: Most rounds a worker takes from the master's welcome (its local-only baseline trains for
#: as many epochs); past it the worker keeps its own config's count and says so.
MAX_ROUNDS = 10_000_000

#: Most samples a worker may declare (weights beyond it are not believable).
MAX_SAMPLES = 1_000_000_000
#: Most occurrences of one word per document a vocabulary registration counts: more cannot
#: come from documents of ordinary length, so the master refuses them, and a worker counts a
#: document that repeats one word more often (a log line pasted 300,000 times) as this many.
MAX_TERM_PER_DOC = 10_000

#: An update whose distance to the model it was built on exceeds this many times the round's
#: lower median distance is refused for that round (a poisoned or broken update; honest ones
#: differ by small factors).
NORM_OUTLIER_FACTOR = 20.0
#: An aggregate whose norm grows more than this many times over the model it replaces is not
#: published: the round is redone without the update furthest out.
NORM_GROWTH_LIMIT = 100.0
#: ... nor more than that many times over the smallest of this many models last published
#: (rounds): growth just under the limit each round compounds.
NORM_GROWTH_WINDOW = 10
#: ... nor more than this many times over the smallest model of the same arrays published in
#: the whole job: a member stepping just under the window's bound once a window compounded
#: without end. Honest jobs grew at most 15 x over it (combinedtm, 100 rounds; mlp 3.6 x in
#: 1,000), a margin of hundreds.
NORM_JOB_GROWTH_LIMIT = 1e4

#: An update or secure sum this close to the model is never left out, and never becomes a
#: floor: a sum whose members all sat out (zeros, and the ring's rounding: 4e-10) was once
#: recorded as a synchronized step's floor, and every honest step after it (12.8) refused.
NEGLIGIBLE_DISTANCE = 1e-6
#: Largest magnitude of any value the master publishes: workers compute in float32 and square
#: what they are sent (variances, norms, distances to centres), so a value past the square root
#: of float32's largest would overflow there, however finite it is in the master's float64.
PUBLISHED_VALUE_LIMIT = 1.8e19

#: A participant that stays silent (alive, but no upload) in this many rounds not forgiven, or
#: that abstains this many times from a multi-round step, is excluded from the rest of the job.
ABSTAIN_LIMIT = 3
#: Steps a member completes for one of its abstentions to be forgiven. Forgiving them all at
#: each completed step let a member that abstained twice a step, then took part, never reach
#: ABSTAIN_LIMIT while each of its steps was redone twice: the job's round budget ran out at
#: a third of its steps. An honest member's rare abstention (a restart mid-step) is forgiven.
ABSTAIN_FORGIVEN_AFTER_STEPS = 5
#: Rounds a participant answers for one of its silent rounds to be forgiven. Forgiving them all
#: at its next answer let a member silent two rounds in three cost every such round its
#: deadline for the whole job (excluded now by its fourth round); a member silent one round
#: in three (slow, or jittery) is never excluded (at 3, it was by round 15).
SILENCE_FORGIVEN_AFTER_ROUNDS = 2

#: Senders whose refused requests the master counts (and logs, once each) by name; the rest
#: are counted together: without CURVE a flood can make up a new name for every request.
MAX_REFUSED_SENDERS = 1000

#: Longest duration a worker may report for a timing metric (``*_time``, ``*_s``), in seconds.
MAX_TIMING_S = 1e6
#: Largest magnitude any reported metric may have.
MAX_METRIC = 1e12

#: ZeroMQ high-water marks: bound the queues so a slow peer cannot exhaust memory.
PUB_SNDHWM = 64
SUB_RCVHWM = 64
#: An honest peer (a REQ socket) has one request in flight a connection: more queued on one
#: connection are a pipelining DEALER's, each up to ``max_message_mb``.
REP_RCVHWM = 4

#: Socket linger on close, in milliseconds: a closing socket drops unsent messages after this.
LINGER_MS = 1000

#: A worker whose subscription has heard no announcement (one every ANNOUNCE_INTERVAL) for
#: this long opens it again: a TCP connection whose own end changed address (a laptop moved to
#: another network, a renumbered host) stays silent, not broken, until TCP gives up (minutes).
SUB_SILENCE_RESUBSCRIBE = 3.0

#: Secure aggregation: how long a stage after the first (shares, masked inputs, unmasking)
#: waits for workers that are alive but slow before it goes on with those it has (at least the
#: threshold). A worker that dies is dropped as soon as its heartbeats stop.
SECAGG_STAGE_TIMEOUT = 60.0

#: Times a secure round is begun again (a participant restarted and lost its secrets, or a
#: stage was left with fewer than the threshold while enough workers live) before it is given
#: up with the model as it was.
SECAGG_MAX_ATTEMPTS = 3
#: Secure sums in a row the master may refuse to apply (not finite, or moving the model past
#: the growth limit) before the job ends saying so: inside a sum no member can be left out,
#: so one member sending such updates would otherwise stall it until its round budget ran
#: out, with nothing trained and no reason given.
SECAGG_MAX_REFUSED_SUMS = 5
#: A secure sum's weights may add up to this many times its members (at most 1 each) before
#: one is known to be out of range: the quantization's rounding, each member's at most
#: 1/levels, is far below it.
SECURE_WEIGHT_SLACK = 1.01
#: Sets of threshold-many shares tried to open a secret one of whose shares is forged (the
#: first ones, in order: a few members' worth of combinations; Lagrange on 32-byte numbers).
SECAGG_MAX_SUBSETS = 1000

#: How long a worker waits before asking again whether the next stage of a secure round is
#: ready, should the master's ``secagg_stage`` word on PUB be lost (it asks at once on it).
SECAGG_POLL_INTERVAL = 0.05

#: Below this NMI between the final clusters and the k-FED start, the closing log and report
#: say FSTC moved far from its start (on the benchmark sets it stays above 0.6; where it fell
#: below, its accuracy had fallen under the start's: issue 29).
FAR_FROM_START_NMI = 0.5
