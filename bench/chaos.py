"""`make chaos`: hang the broker, then kill -9 every service and the broker under load; count what was lost.

It runs ``driftline up --replay-limit N --speed 0`` on free ports (``tests.loopstack``), with
the traffic driver writing every request id it got a 200 for (``replay.answered_log``), and a
capture that tails ``features``, ``actions`` and ``examples`` from their start, across broker
resets (:class:`services.broker_reset.EpochWatch`). Once the loop has closed it stops the broker
for ``CHAOS_HANG_S`` (60) seconds (SIGSTOP: its data kept; :func:`hang_broker`), then kill -9s the
joiner twice, the dumper, the trainer and serving (the supervisor restarts each), then the
broker (tansu, memory storage: every topic is gone). Nobody touches anything after that: the
run waits for the traffic to end and the pipeline to drain, stops the stack with Ctrl-C and
compares.

The last line printed is one JSON object: ``restarted_by_broker_hang`` (services the hang made
exit; ``idle_advances_during_broker_hang``, ``broker_hang_recovered`` beside it),
``answered_feature_logs_lost`` (request ids answered
200 that never reached ``features``), ``conflicting_duplicates`` (example ids with two different
contents, on the topic or in Parquet), ``parquet_rows_deleted`` (example ids in Parquet before the
broker reset and not after), ``crash_loops`` (services the supervisor saw crash-looping),
``missing_vs_reference`` (examples the offline reference join of the captured topics has, windows
still open excluded, that Parquet lacks), ``missing_vs_join_rules`` (the same for the examples
:class:`joiner.core.JoinCore` gives when the captured topics are replayed through it, each new
broker epoch starting from the watermarks the worker restored at the reset: what the worker lost
of what the broker served, and what the killed broker served the capture but not the worker
before it died: clicks have no copy outside the broker, feature logs have serving's re-ship) and ``broker_reset_recovered`` (every service made
progress on the new broker on its own), plus the numbers behind them: among them
``offsets_with_two_records`` (offsets of the new broker's topics the capture read two different
records at: tansu quirk 8; a run with none has had no miss since the joiner fixes of issue 15) and
``joiner_counts_since_last_start`` (the joiner's verdict counters after the reset),
``recent_clicks_repeated`` (items a user's recent clicks in Redis hold twice: an action recorded
twice, as the reader re-reads after its kill; a run before the store recorded each action once had
16), and
``missing_at_two_record_offsets`` / ``label_mismatch_at_two_record_offsets``: how many of the
missing and relabelled examples had their feature log or an action first read at such an offset
(one run with 538 such offsets: 69 of 69 missing and 11 of 12 relabelled). The capture's other
blind spot: it tails the topics a little behind, so what the killed broker served the joiner and
not yet the capture is gone from the reference. The run kills the broker just after the capture
has read every input record the broker reported (``capture_caught_up_at_broker_kill``; it waits
up to 30 s), which narrows that to what is produced in the last moment; on a slow machine the
moment can still be a second of records. A run can then show clicks the reference never saw
(relabelled ``negative f0 a[]``: ours positive, no captured action), and clicks and feature logs
judged late or expired by a watermark those unseen records had moved: at full replay speed a
client's retry (the traffic driver backs off up to 4 s after serving's kill) lands its clicks
minutes of event time behind the ones sent meanwhile. The replay behind ``missing_vs_join_rules``
therefore starts the new epoch from the watermarks the worker restored (it logs them when it
reopens a partition: ``restored_watermarks`` in the JSON line);
``missing_vs_join_rules_on_captured_watermarks`` is the replay on the capture's view alone. (Two
runs before the replay did: 157 and 172 missing against the reference, 157 and 56 against the
capture's rules, 0 and 0 from the restored watermarks; the workers' watermarks were 20-65
event-seconds past the capture's.) ``QUICK=1``
runs a smaller replay with shorter pauses (under 5 minutes); the full run stays under 15.

``CHAOS_KEEP=<dir>`` keeps the run's directory with, for a post-mortem, ``chaos-missing.json``
(per missing example: its labels, and the broker epochs its feature log and actions came in),
``chaos-mismatch.json`` (the same for a label that differs), ``chaos-topics.csv`` (every input
record the capture read: topic, epoch, partition, offset, id, event time) and
``chaos-topics.pickle`` (the same with each feature log's first copy: enough to replay the join).

(Over 450 lines, one module: the capture, the faults and the comparison share one run's state;
the post-mortem's replay and offset checks live in ``chaos_postmortem.py``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokafka import AIOKafkaConsumer, TopicPartition
from chaos_postmortem import at_two_record_offsets, missing_detail, offsets_with_two_records, replay_join, restored_watermarks

from joiner.config import JoinConfig
from joiner.dumper import read_examples
from proto import Action, FeatureLog, ModelVersion
from services import broker_reset, example_batch
from services.aiokafka_quirks import stop_consumer
from services.settings import Settings
from tests.joiner.reference import offline_join
from tests.loopstack import LoopStack

REPO = Path(__file__).resolve().parent.parent
KILLED = ("joiner", "joiner", "dumper", "trainer", "serving")


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Capture:
    """What reached the topics, epoch by epoch, deduplicated by content (a reset re-reads)."""

    settings: Settings
    epochs: int = 0
    # request_id -> (partition key, stripped FeatureLog bytes, event time): first copy
    features: dict[str, tuple[bytes, bytes, int]] = field(default_factory=dict)
    feature_order: list[str] = field(default_factory=list)
    actions: dict[tuple, tuple[bytes, bytes]] = field(default_factory=dict)
    # the broker epoch each first copy was read in (0: the first broker), for the post-mortem
    feature_epoch: dict[str, int] = field(default_factory=dict)
    action_epoch: dict[tuple, int] = field(default_factory=dict)
    examples: dict[str, bytes] = field(default_factory=dict)
    example_epoch: dict[str, int] = field(default_factory=dict)
    example_conflicts: set[str] = field(default_factory=set)
    # every input record read, copies too: (topic "f"/"a", epoch, partition, offset, request id
    # (an action: request/item), event time, and an action's type)
    topic_log: list[tuple] = field(default_factory=list)
    # when the capture last had every input record the broker had reported (monotonic clock)
    caught_up_at: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        t = self.settings.topics
        topics = [t.features, t.actions, t.examples]
        watch = broker_reset.EpochWatch(self.settings, "chaos-capture")
        await watch.start()
        c = AIOKafkaConsumer(bootstrap_servers=self.settings.bootstrap_servers, enable_auto_commit=False,
                             group_id=None, max_partition_fetch_bytes=8 << 20)
        await c.start()
        try:
            while not self.stop.is_set():
                await c._client.force_metadata_update()
                tps = [TopicPartition(topic, p) for topic in topics for p in sorted(c.partitions_for_topic(topic) or [])]
                if len(tps) < 3:
                    await asyncio.sleep(0.5)
                    continue
                c.assign(tps)
                await c.seek_to_beginning(*tps)
                while not self.stop.is_set():
                    try:
                        fetched = await c.getmany(timeout_ms=300, max_records=5000)
                    except Exception as err:  # noqa: BLE001 - the broker is being killed
                        log(f"capture: {err!r}")
                        await asyncio.sleep(0.5)
                        fetched = {}
                    if await watch.check() is not None:
                        self.epochs += 1
                        log(f"capture: broker reset seen (epoch {self.epochs}); re-reading the new topics")
                        break  # this fetch may hold new-epoch records at stale offsets: re-read all
                    for tp, records in fetched.items():
                        for r in records:
                            self._add(tp.topic, r.key, r.value, tp.partition, r.offset)
                    if await self._read_all(c, [tp for tp in tps if tp.topic != t.examples]):
                        self.caught_up_at = time.monotonic()
        finally:
            await stop_consumer(c)  # the broker may be gone: aiokafka quirk 1
            await watch.stop()

    @staticmethod
    async def _read_all(c: AIOKafkaConsumer, tps: list[TopicPartition]) -> bool:
        """Whether the capture's position is at the high watermark of every partition in ``tps``,
        as the broker's last fetch responses gave it."""
        for tp in tps:
            hw = c.highwater(tp)
            if hw is None or await c.position(tp) < hw:
                return False
        return True

    def wait_caught_up(self, timeout_s: float) -> bool:
        """Block until the capture has just read every input record the broker reported (or
        ``timeout_s`` passed): killed then, the broker takes with it at most what was produced
        in the last moment, not a second of records the joiner read and the capture did not
        (their watermarks and clicks would be missing from the reference)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if time.monotonic() - self.caught_up_at < 0.05:
                return True
            time.sleep(0.005)
        return False

    def _add(self, topic: str, key: bytes, value: bytes, partition: int, offset: int) -> None:
        t = self.settings.topics
        if topic == t.features:
            fl = FeatureLog.FromString(value)
            self.topic_log.append(("f", self.epochs, partition, offset, fl.request_id, fl.event_time_ms))
            if fl.request_id not in self.features:
                stripped = FeatureLog(request_id=fl.request_id, event_time_ms=fl.event_time_ms, user_id=fl.user_id,
                                      model_version=ModelVersion(model_id=fl.model_version.model_id))
                for cand in fl.candidates:
                    stripped.candidates.add(item_id=cand.item_id)
                self.features[fl.request_id] = (key, stripped.SerializeToString(), fl.event_time_ms)
                self.feature_order.append(fl.request_id)
                self.feature_epoch[fl.request_id] = self.epochs
        elif topic == t.actions:
            a = Action.FromString(value)
            self.topic_log.append(("a", self.epochs, partition, offset, f"{a.request_id}/{a.item_id}", a.event_time_ms,
                                   a.action_type))
            k = (a.request_id, a.item_id, a.action_type, a.event_time_ms)
            if k not in self.actions:
                self.actions[k] = (key, value)
                self.action_epoch[k] = self.epochs
        else:  # one record = a batch of examples; compared example by example
            for e in example_batch.to_examples(example_batch.decode(value)):
                raw = e.SerializeToString(deterministic=True)
                seen = self.examples.setdefault(e.example_id, raw)
                self.example_epoch.setdefault(e.example_id, self.epochs)
                if seen != raw:
                    self.example_conflicts.add(e.example_id)


def _supervisor_state(stack: LoopStack) -> dict:
    try:
        return json.loads((stack.var_dir / "run" / "supervisor.json").read_text())
    except (OSError, ValueError):
        return {}


def _kill(stack: LoopStack, name: str, killed: set[int]) -> None:
    """kill -9 the service's process group (its children too: the trainer's loader), once the
    supervisor runs it under a pid not killed before (it may still be restarting it)."""
    deadline = time.monotonic() + 60
    while True:
        pid = _supervisor_state(stack).get(name, {}).get("pid")
        if pid is not None and pid not in killed:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            else:
                killed.add(pid)
                log(f"kill -9 {name} (pid {pid})")
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} has no running pid in supervisor.json to kill")
        time.sleep(0.2)


def _parquet_ids(stack: LoopStack) -> dict[str, list[tuple]]:
    root = stack.var_dir / "examples"
    table = read_examples(root) if root.exists() else None
    if table is None or table.num_rows == 0:
        return {}
    labels = sorted(c for c in table.column_names if c.startswith("label_"))
    cols = [table[c].to_pylist() for c in ["example_id", "sample_rate", *labels]]
    out: dict[str, list[tuple]] = defaultdict(list)
    for eid, rate, *lab in zip(*cols):
        out[eid].append((round(rate, 6), *lab))
    return out


def recent_clicks_repeated(stack: LoopStack) -> int:
    """Entries of the users' recent-clicks lists in Redis that repeat an item of the same list."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=stack.redis_port, socket_timeout=10)
    prefix = stack.settings().serving.redis_prefix
    try:
        lists = [client.lrange(key, 0, -1) for key in client.scan_iter(f"{prefix}:clicks:*", count=1000)]
    finally:
        client.close()
    return sum(len(items) - len(set(items)) for items in lists)


def _wait(stack: LoopStack, what: str, check, timeout_s: float) -> bool:
    try:
        stack.wait_for(what, check, timeout_s)
        return True
    except AssertionError as err:
        log(f"not reached: {str(err).splitlines()[0]}")
        return False


def _metric(stack: LoopStack, service: str, name: str, labels: dict | None = None) -> float:
    return stack.metric(service, name, labels) or 0.0


def _metric_sum(stack: LoopStack, service: str, name: str) -> float:
    """The sum of every sample of ``name`` on ``service``'s /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        _, body = stack.get(stack.metrics_urls()[service])
    except OSError:
        return 0.0
    return sum(s.value for fam in text_string_to_metric_families(body) for s in fam.samples
               if s.name == name or s.name == name + "_total")


def hang_broker(stack: LoopStack, seconds: float) -> dict:
    """SIGSTOP the broker for ``seconds`` (a long pause, a network that drops packets: its data
    kept, its connections open), then SIGCONT. Every service waits it out, none exits (the
    supervisor restarts nothing), and the joiner does not take the silence for idle actions
    (its idle advance would close windows whose clicks wait on the hung broker); the losses it
    would cause show in the run's comparison with the reference like any other."""
    state = _supervisor_state(stack)
    before = {name: s.get("restarts", 0) for name, s in state.items()}
    idle_before = _metric_sum(stack, "joiner", "driftline_joiner_idle_advances")
    produced = _metric_sum(stack, "joiner", "driftline_joiner_examples_produced")
    trained = _metric_sum(stack, "trainer", "driftline_trainer_examples")
    pid = state["broker"]["pid"]
    log(f"SIGSTOP broker (pid {pid}) for {seconds:.0f} s")
    os.killpg(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
        idle_during = _metric_sum(stack, "joiner", "driftline_joiner_idle_advances") - idle_before
    finally:
        os.killpg(pid, signal.SIGCONT)
    log("SIGCONT broker")
    recovered = {
        "joiner": _wait(stack, "the joiner emits after the hang", lambda: _metric_sum(
            stack, "joiner", "driftline_joiner_examples_produced") > produced, 180),
        "trainer": _wait(stack, "the trainer trains after the hang", lambda: _metric_sum(
            stack, "trainer", "driftline_trainer_examples") > trained, 180),
    }
    time.sleep(15)  # (an exit the hang caused can come a little after it: a send given up on)
    after = _supervisor_state(stack)
    restarted = {name: s.get("restarts", 0) - before.get(name, 0) for name, s in after.items()
                 if s.get("restarts", 0) > before.get(name, 0)}
    log(f"after the hang: restarted {restarted}, idle advances during it {idle_during:.0f}, recovered {recovered}")
    return {"restarted_by_broker_hang": restarted, "idle_advances_during_broker_hang": idle_during,
            "broker_hang_recovered": all(recovered.values()), "broker_hang_s": seconds}


def run_chaos(work: Path, quick: bool) -> dict:
    limit = int(os.environ.get("CHAOS_LIMIT", 60_000 if quick else 150_000))
    speed = os.environ.get("CHAOS_SPEED", "0")  # event-time speed-up of the traffic; 0: as fast as it goes
    pause = 4.0 if quick else 8.0
    answered = work / "answered.txt"
    stack = LoopStack.start(work, REPO, "--replay-limit", str(limit), "--speed", speed,
                            env={"DRIFTLINE_REPLAY__ANSWERED_LOG": str(answered)})
    settings = stack.settings()
    capture = Capture(settings)
    reader = threading.Thread(target=capture.run, daemon=True)
    reader.start()
    result: dict = {}
    try:
        started = time.monotonic()
        _wait(stack, "examples flowing", lambda: _metric(stack, "joiner", "driftline_joiner_examples_produced_total") > 500, 180)
        hang = hang_broker(stack, float(os.environ.get("CHAOS_HANG_S", 60)))
        killed: set[int] = set()
        for name in KILLED:
            time.sleep(pause)
            _kill(stack, name, killed)
        time.sleep(pause)
        _wait(stack, "serving back", lambda: stack.get(stack.serving_url + "/readyz")[0] == 200, 90)
        # The dumper flushes every 30 s: kill the broker once Parquet holds rows, so "no Parquet row
        # deleted by the reset" is checked against something.
        _wait(stack, "Parquet written before the reset", lambda: len(_parquet_ids(stack)) > 0, 120)
        before = _parquet_ids(stack)
        version_before = stack.json("/readyz")["model_version"]["sparse_version"]
        examples_before = len(capture.examples)
        caught_up = capture.wait_caught_up(30)
        _kill(stack, "broker", killed)
        reset_at = time.monotonic()
        _wait(stack, "the reset seen", lambda: capture.epochs >= 1, 120)
        trained_before = _metric_sum(stack, "trainer", "driftline_trainer_examples_total")
        # Recovery on its own: every service makes progress on the new broker.
        checks = {
            "traffic on the new broker": lambda: capture.epochs >= 1 and len(capture.features) > 0,
            "joiner emits on the new broker": lambda: capture.epochs >= 1 and any(
                ep >= 1 for ep in capture.example_epoch.values()),
            "dumper writes new-epoch examples": lambda: any(
                eid in _parquet_ids(stack) for eid, ep in list(capture.example_epoch.items()) if ep >= 1),
            "trainer trains on the new broker": lambda: capture.epochs >= 1 and _metric_sum(
                stack, "trainer", "driftline_trainer_examples_total") > trained_before,
            "serving applies new deltas": lambda: stack.json("/readyz")["model_version"]["sparse_version"] > version_before,
        }
        recovered = {what: _wait(stack, what, check, 240) for what, check in checks.items()}
        log(f"recovery: {recovered} ({time.monotonic() - reset_at:.0f} s)")
        _wait(stack, "traffic done", lambda: '"requests"' in (stack.log_dir / "replay.log").read_text(), 600)
        # Drain: actions idle -> the joiner's idle advance closes windows; the dumper flushes every 30 s.
        stable, last = 0, -1
        deadline = time.monotonic() + 240
        while stable < 3 and time.monotonic() < deadline:
            time.sleep(15)
            n = sum(len(v) for v in _parquet_ids(stack).values())
            stable = stable + 1 if n == last else 0
            last = n
        wa = {}
        from prometheus_client.parser import text_string_to_metric_families

        _, body = stack.get(stack.metrics_urls()["joiner"])
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                if s.name == "driftline_joiner_watermark_ms" and s.labels.get("stream") == "actions":
                    wa[int(s.labels["partition"])] = int(s.value)
        # the last joiner process's verdicts (it started after the reset): why impressions were dropped
        verdicts = {name: _metric_sum(stack, "joiner", f"driftline_joiner_{name}_total") for name in (
            "impressions", "duplicate_impressions", "expired_impressions", "actions", "joined_actions",
            "late_actions", "orphan_actions", "idle_advances", "positives", "examples_produced")}
        lost_reported = {svc: _metric_sum(stack, svc, "driftline_broker_reset_lost_total")
                         for svc in ("joiner", "dumper", "trainer", "serving")}
        repeated_clicks = recent_clicks_repeated(stack)
    finally:
        code = stack.stop(timeout_s=90)
        capture.stop.set()
        reader.join(timeout=10)
    stop_text = stack.text()
    after = _parquet_ids(stack)
    state = _supervisor_state(stack)
    dumper_log = stack.log_dir / "dumper.log"
    stops = [ln for ln in dumper_log.read_text(errors="replace").splitlines()
             if "dumper stopped:" in ln] if dumper_log.exists() else []

    # --- answered vs logged
    answered_ids = set(answered.read_text().split()) if answered.exists() else set()
    lost = answered_ids - set(capture.features)
    # --- duplicates and conflicts
    parquet_conflicts = sum(1 for rows in after.values() if len(set(rows)) > 1)
    parquet_dups = sum(len(rows) - 1 for rows in after.values())
    deleted = sum(len(rows) for eid, rows in before.items() if eid not in after)
    # --- reference join of what reached the topics (state kept across the reset: one stream)
    cfg = JoinConfig.from_settings(settings.joiner)
    events = [("features", key, value) for key, value, _ in (capture.features[r] for r in capture.feature_order)]
    events += [("actions", key, value) for key, value in capture.actions.values()]
    ref = offline_join(events, cfg, settings.topics.partitions)
    from aiokafka.partitioner import DefaultPartitioner

    part = DefaultPartitioner()
    parts = list(range(settings.topics.partitions))
    t_of = {}
    for rid, (key, _, t) in capture.features.items():
        t_of[rid] = (t, part(key, parts, parts))
    closes = cfg.window_ms + cfg.lateness_ms

    def closed(eid: str, labels: dict) -> bool:
        t, p = t_of[eid.rsplit("/", 1)[0]]
        return any(labels.values()) or t + closes < wa.get(p, 0)

    expected = {eid for eid, (labels, _, _) in ref.items() if closed(eid, labels)}
    missing = expected - set(after)

    def missing_in_replay(restored: dict) -> set[str]:
        """What the join's own rules give on what the broker served (JoinCore over the captured
        topics) that Parquet lacks."""
        replayed = replay_join(capture, cfg, restored)
        return {eid for eid, positive in replayed.items() if closed(eid, {"any": positive}) and eid not in after}

    joiner_log = stack.log_dir / "joiner.log"
    restored = restored_watermarks(joiner_log.read_text(errors="replace") if joiner_log.exists() else "")
    missing_vs_rules = missing_in_replay(restored)
    missing_vs_captured_rules = missing_in_replay({})
    mismatched = {eid for eid in expected & set(after)
                  if tuple(ref[eid][0][k] for k in sorted(ref[eid][0])) != after[eid][0][1:]}
    wrong_label = len(mismatched)
    why = missing_detail(capture, ref, missing, t_of)
    (work / "chaos-missing.json").write_text(json.dumps(why, indent=1))
    with (work / "chaos-topics.csv").open("w") as f:  # every input record's place, for a post-mortem
        f.write("topic,epoch,partition,offset,id,event_time_ms\n")
        f.writelines(",".join(map(str, row[:6])) + "\n" for row in capture.topic_log)
    with (work / "chaos-topics.pickle").open("wb") as f:  # the same, replayable: each feature log's first copy
        pickle.dump({"log": capture.topic_log, "features": {rid: v[1] for rid, v in capture.features.items()}}, f)
    # the same detail for a label that differs, with ours and the epoch our example reached the topic in
    differ = missing_detail(capture, ref, mismatched, t_of)
    for eid, d in differ.items():
        d.update(ours=after[eid][0][1:], example_epoch=capture.example_epoch.get(eid))
        d["origin"] += f" e{capture.example_epoch.get(eid)}"
    (work / "chaos-mismatch.json").write_text(json.dumps(differ, indent=1))
    result = {
        "answered_feature_logs_lost": len(lost),
        # services the broker's hang (before the kills) made exit: the supervisor restarted them
        "restarted_by_broker_hang": sum(hang["restarted_by_broker_hang"].values()),
        "conflicting_duplicates": parquet_conflicts + len(capture.example_conflicts),
        "parquet_rows_deleted": deleted,
        "crash_loops": sum(v.get("crash_loops", 0) for v in state.values()),
        "missing_vs_reference": len(missing),
        "missing_vs_join_rules": len(missing_vs_rules),
        # the same replay without the watermarks the worker restored at the reset (the capture's
        # view alone): the difference is what the killed broker served the joiner and not the capture
        "missing_vs_join_rules_on_captured_watermarks": len(missing_vs_captured_rules),
        "capture_caught_up_at_broker_kill": caught_up,
        "restored_watermarks": {str(ep): {str(p): list(m) for p, m in parts.items()}
                                for ep, parts in restored.items()},
        "missing_sample": sorted(missing)[:20],  # example ids to look up in a kept work dir
        # by the broker epoch they reached the topic in (0: the first broker); those of epoch 0 that
        # the dumper never read lived only in the killed broker (docs/broker-reset.md)
        # (reference label, epoch of its feature log, epochs of its actions): where they came from
        "missing_by_origin": dict(Counter(d["origin"] for d in why.values())),
        "missing_by_epoch": {str(ep): sum(1 for eid in missing if capture.example_epoch.get(eid) == ep)
                             for ep in sorted({capture.example_epoch.get(eid) for eid in missing}, key=str)},
        # (reference label, epochs of its feature log and actions, epoch our example reached)
        "label_mismatch_by_origin": dict(Counter(d["origin"] for d in differ.values())),
        "broker_reset_recovered": all(recovered.values()),
        "recovery": recovered,
        "answered_requests": len(answered_ids),
        "feature_logs_on_topic": len(capture.features),
        "actions_on_topic": len(capture.actions),
        "examples_on_topic": len(capture.examples),
        "examples_on_topic_before_reset": examples_before,
        "topic_conflicting_duplicates": len(capture.example_conflicts),
        "parquet_conflicting_duplicates": parquet_conflicts,
        "parquet_exact_duplicates": parquet_dups,
        "parquet_examples_before_reset": len(before),
        "parquet_examples_after": len(after),
        "reference_examples_closed": len(expected),
        # offsets the capture read twice with different records: the broker served two records under
        # one offset after its restart (tansu quirk 8); an offset-tracking reader gets one of them
        "offsets_with_two_records": offsets_with_two_records(capture.topic_log),
        "label_mismatch_vs_reference": wrong_label,
        # of those, the ones whose feature log or action the broker served under an offset it also
        # served another record under (tansu quirk 8: lost for the joiner, not by it)
        "missing_at_two_record_offsets": len(at_two_record_offsets(capture.topic_log, missing)),
        "label_mismatch_at_two_record_offsets": len(at_two_record_offsets(capture.topic_log, mismatched)),
        # items a user's recent clicks hold more than once: the replay clicks each (user, item)
        # once at most (ml-1m rates each pair once), so each is an action recorded twice
        "recent_clicks_repeated": repeated_clicks,
        "broker_epochs": capture.epochs + 1,
        "reset_lost_reported": lost_reported,
        "joiner_counts_since_last_start": verdicts,
        "restarts": {k: v.get("restarts", 0) for k, v in state.items()},
        "dumper_last_run": stops[-1].split("dumper stopped:", 1)[1].strip() if stops else None,
        "stop_exit_code": code,
        "stopped_cleanly": code == 0 and "not cleanly" not in stop_text,
        "seconds": round(time.monotonic() - started, 1),
        "quick": quick,
    }
    result.update({k: v for k, v in hang.items() if k != "restarted_by_broker_hang"},
                  restarted_by_broker_hang_by_service=hang["restarted_by_broker_hang"])
    return result


def run_main(run: Callable[[Path, bool], dict], prefix: str) -> int:
    """Run ``run(work_dir, quick)`` (``QUICK=1``) in a temporary folder, or in ``CHAOS_KEEP`` (kept:
    logs and state for a post-mortem), and print its result as the last line, one JSON object."""
    import logging

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # captures outlive the broker
    quick = os.environ.get("QUICK") == "1"
    keep = os.environ.get("CHAOS_KEEP")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        result = run(Path(keep), quick)
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            result = run(Path(tmp), quick)
    print(json.dumps(result), flush=True)
    return 0


def main() -> int:
    return run_main(run_chaos, "driftline-chaos-")


if __name__ == "__main__":
    raise SystemExit(main())
