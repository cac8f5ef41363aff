"""Every setting of every driftline service, with its default, in one place.

(Long on purpose: one place for every setting, so each default, bound and comment is written once;
the README's settings table is checked against it by ``tests/test_settings_readme.py``.)

Each field can be overridden by an environment variable: ``DRIFTLINE_<FIELD>`` for top-level
fields and ``DRIFTLINE_<SECTION>__<FIELD>`` for a section's (for example
``DRIFTLINE_JOINER__WINDOW_SECONDS=600``). Two variables keep their conventional names because
users already have them set: ``KAFKA_BOOTSTRAP_SERVERS`` and ``REDIS_URL``. When either is set,
``make up`` starts nothing embedded for it and uses that server instead.

>>> s = Settings()
>>> s.topics.features, s.topics.param_deltas
('features', 'param-deltas')
>>> import os; os.environ["DRIFTLINE_JOINER__WINDOW_SECONDS"] = "42"
>>> Settings().joiner.window_seconds
42.0
>>> del os.environ["DRIFTLINE_JOINER__WINDOW_SECONDS"]

Bounds and enumerations live on the fields (``Field(gt=0, le=1)``, ``Literal``), so a bad value
fails here, once, with pydantic's message naming the setting; the code that reads a setting
trusts it. The project file (driftline/project.py) declares its keys with the same types
(:data:`SampleRate`, :data:`LabelMap`...), so it refuses what the settings refuse:

>>> os.environ["DRIFTLINE_JOINER__NEGATIVE_SAMPLE_RATE"] = "1.5"
>>> Settings()
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for Settings
joiner.negative_sample_rate
  Input should be less than or equal to 1 [type=less_than_equal]
...
>>> del os.environ["DRIFTLINE_JOINER__NEGATIVE_SAMPLE_RATE"]
"""

from __future__ import annotations

import ipaddress
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails
from pydantic_settings import BaseSettings, SettingsConfigDict

# The types settings share with the project file's keys (driftline/project.py): one declaration
# of each bound, whichever edge the value comes in by.

#: a share of negative examples the joiner keeps (the trainer measures it, serving corrects by it)
SampleRate = Annotated[float, Field(gt=0, le=1)]
#: a duration that must pass (a window, an interval, a timeout)
PositiveSeconds = Annotated[float, Field(gt=0)]
#: a duration that may be zero (a grace, a margin)
Seconds = Annotated[float, Field(ge=0)]
#: a whole number of at least one (a batch, a partition, a size, a timeout in ms)
Count = Annotated[int, Field(ge=1)]
#: a TCP port (0, for the /metrics port: a free one)
Port = Annotated[int, Field(ge=0, le=65535)]
#: what the joiner does with an action that arrives after its impression's window closed
LatePolicy = Literal["drop", "correction"]
#: when the joiner emits a joined positive: as soon as it joins, or when its window closes
PositiveEmit = Literal["immediate", "window_close"]
#: what serving does with a /rank naming a feature the model does not read
UnknownFeatures = Literal["reject", "ignore"]
#: a torch device the trainer may place its dense part on (trainer.device)
TorchDevice = Annotated[str, Field(pattern=r"^(cpu|cuda(:\d+)?)$")]
#: distinct labels the joiner can join: an impression's label mask is 16 bits (joiner/core.py, HEADER)
MAX_LABELS = 16


def _few_labels(label_map: dict[str, str]) -> dict[str, str]:
    """At most :data:`MAX_LABELS` distinct labels.

    >>> _few_labels({f"a{i}": f"l{i}" for i in range(17)})
    Traceback (most recent call last):
    ...
    ValueError: at most 16 distinct labels, not 17
    """
    labels = set(label_map.values())
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} distinct labels, not {len(labels)}")
    return label_map


#: action type -> the label it sets
LabelMap = Annotated[dict[str, str], AfterValidator(_few_labels)]


class TopicSettings(BaseModel):
    """Topic names and partition counts. Partitions bound how far a consumer group scales out."""

    features: str = "features"
    actions: str = "actions"
    examples: str = "examples"
    param_deltas: str = "param-deltas"
    dead_letters: str = "dead-letters"
    partitions: Count = 4
    # Parameter deltas must be applied in version order, so they live on one partition.
    param_delta_partitions: Count = 1

    def all(self) -> dict[str, int]:
        """Topic name -> partition count, for topic creation."""
        return {
            self.features: self.partitions,
            self.actions: self.partitions,
            self.examples: self.partitions,
            self.param_deltas: self.param_delta_partitions,
            self.dead_letters: 1,
        }


class KafkaClientSettings(BaseModel):
    """aiokafka client tuning shared by all services."""

    # tansu makes a consumer's first join wait about half the session timeout: keep it short.
    session_timeout_ms: Count = 10_000
    heartbeat_interval_ms: Count = 3_000
    request_timeout_ms: Count = 30_000
    linger_ms: NonNegativeInt = 5
    max_batch_size: Count = 1_048_576
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = "lz4"
    max_poll_records: Count = 2_000
    # tansu answers a fetch only when this wait is over, even with records waiting (quirk 7): it
    # is every consumer's latency. Apache Kafka answers as soon as a record is there.
    fetch_max_wait_ms: NonNegativeInt = 100
    connect_timeout_s: PositiveSeconds = 10.0

    # Connection security, the same for every client (services/kafka_security.py turns it into
    # their options). SASL_* authenticates with sasl_username and the password; *SSL encrypts,
    # checking the broker's certificate against ssl_cafile (unset: the system's CAs).
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    # The password's file instead (a Docker or Kubernetes secret): its first line is the password.
    sasl_password_file: Path | None = None
    ssl_cafile: Path | None = None
    # A client certificate (mutual TLS); its key in ssl_keyfile, or in the certificate file.
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_key_password: SecretStr | None = None

    # (settings errors would otherwise print the section's input, the password with it)
    model_config = ConfigDict(hide_input_in_errors=True)

    @model_validator(mode="after")
    def _check_security(self, info: ValidationInfo) -> KafkaClientSettings:
        """Refuse security settings that contradict each other, or name files that are not there.

        A project file's ``[settings.kafka]`` is checked alone first (``context={"section_only":
        True}``): the environment may still add the rest, e.g. the password.

        >>> KafkaClientSettings(security_protocol="SASL_SSL", sasl_password="pw")
        Traceback (most recent call last):
        ...
        pydantic_core._pydantic_core.ValidationError: 1 validation error for KafkaClientSettings
          Value error, kafka.security_protocol SASL_SSL needs kafka.sasl_username (DRIFTLINE_KAFKA__SASL_USERNAME) [type=value_error]
        ...
        """
        if info.context and info.context.get("section_only"):
            return self
        problems = self.security_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def security_problems(self) -> list[str]:
        """What is wrong with the security settings, one line each (empty: nothing).

        >>> KafkaClientSettings.model_construct(sasl_username="u").security_problems()
        ['kafka.sasl_username is set but kafka.security_protocol is PLAINTEXT: it would never be sent; set DRIFTLINE_KAFKA__SECURITY_PROTOCOL=SASL_SSL (or SASL_PLAINTEXT)']
        """
        proto, out = self.security_protocol, []
        sasl, tls = proto.startswith("SASL_"), proto.endswith("SSL")
        if sasl:
            if not self.sasl_username:
                out.append(f"kafka.security_protocol {proto} needs kafka.sasl_username (DRIFTLINE_KAFKA__SASL_USERNAME)")
            if self.sasl_password is None and self.sasl_password_file is None:
                out.append(f"kafka.security_protocol {proto} needs kafka.sasl_password or kafka.sasl_password_file "
                           "(DRIFTLINE_KAFKA__SASL_PASSWORD_FILE, e.g. a Docker secret)")
            if self.sasl_password is not None and self.sasl_password_file is not None:
                out.append("kafka.sasl_password and kafka.sasl_password_file are both set: set one")
        else:
            given = [n for n in ("sasl_username", "sasl_password", "sasl_password_file") if getattr(self, n) is not None]
            if given:
                out.append(f"kafka.{given[0]} is set but kafka.security_protocol is {proto}: it would never be "
                           "sent; set DRIFTLINE_KAFKA__SECURITY_PROTOCOL=SASL_SSL (or SASL_PLAINTEXT)")
        files = [n for n in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(self, n) is not None]
        if not tls and (files or self.ssl_key_password is not None):
            name = files[0] if files else "ssl_key_password"
            out.append(f"kafka.{name} is set but kafka.security_protocol is {proto}: TLS is off; set "
                       "DRIFTLINE_KAFKA__SECURITY_PROTOCOL=SSL (or SASL_SSL)")
        if self.ssl_certfile is None and (self.ssl_keyfile is not None or self.ssl_key_password is not None):
            out.append("kafka.ssl_keyfile and kafka.ssl_key_password need kafka.ssl_certfile (the client certificate)")
        for name in [*files, *(["sasl_password_file"] if self.sasl_password_file is not None else [])]:
            path = getattr(self, name)
            if not path.is_file():
                out.append(f"kafka.{name} {path}: no such file")
        if self.sasl_password_file is not None and self.sasl_password_file.is_file() and not self.sasl_password_value():
            out.append(f"kafka.sasl_password_file {self.sasl_password_file} is empty")
        return out

    def sasl_password_value(self) -> str | None:
        """The SASL password: ``sasl_password``, else the first line of ``sasl_password_file``
        (read on every call, so a rotated secret is picked up by the next client)."""
        if self.sasl_password is not None:
            return self.sasl_password.get_secret_value()
        if self.sasl_password_file is None:
            return None
        lines = self.sasl_password_file.read_text().splitlines()
        return lines[0] if lines else ""


class EventTimeSettings(BaseModel):
    """Which event times the edges accept (``/rank``, ``/actions``, the producers, the replay).

    An event time outside ``[now - max_past_s, now + max_future_s]`` (wall clock) is refused with
    a 4xx or dead-lettered: one far-future timestamp would otherwise move the joiner's watermarks.
    Replays of old data raise ``max_past_s`` (``driftline up`` does for its demo data).
    """

    # A week: actions may follow their impression by days; older is a replay (raise it) or a bug.
    max_past_s: Seconds = 7 * 86_400.0
    # Clock skew between a client and us.
    max_future_s: Seconds = 300.0


#: the /metrics port of each service ``make up`` starts: ``embedded.metrics_port_base`` + this
LOCAL_METRICS_OFFSETS = {"joiner": 0, "dumper": 1, "trainer": 2, "traffic": 3, "feature-keeper": 4}


class EmbeddedSettings(BaseModel):
    """The local stack that ``make up`` starts when no external Kafka or Redis is configured."""

    # A loopback address only: neither server can authenticate clients or encrypt (README: Security).
    host: str = "127.0.0.1"
    broker_port: Port = 9092
    redis_port: Port = 6379
    # Services started by `make up` export /metrics on consecutive ports from here.
    metrics_port_base: Port = 9101
    start_timeout_s: PositiveSeconds = 20.0
    # A service whose liveness check (its /metrics or /healthz answering a GET within 2 s, every
    # 5 s) has not passed for this long is killed and restarted: a hung process is not left in place.
    liveness_timeout_s: PositiveSeconds = 120.0

    def metrics_port(self, service: str) -> int:
        """The /metrics port ``make up`` gives ``service`` (a key of :data:`LOCAL_METRICS_OFFSETS`).

        >>> EmbeddedSettings(metrics_port_base=9200).metrics_port("trainer")
        9202
        """
        return self.metrics_port_base + LOCAL_METRICS_OFFSETS[service]

    @field_validator("host")
    @classmethod
    def _loopback_only(cls, host: str) -> str:
        """The embedded broker and Redis take anyone who can connect: no other host may.

        >>> EmbeddedSettings(host="0.0.0.0")
        Traceback (most recent call last):
        ...
        pydantic_core._pydantic_core.ValidationError: 1 validation error for EmbeddedSettings
        host
          Value error, embedded.host 0.0.0.0 is not a loopback address: the embedded broker and Redis have no authentication nor TLS and listen on 127.0.0.1 only; for servers other hosts can reach, run your own and set KAFKA_BOOTSTRAP_SERVERS and REDIS_URL [type=value_error, input_value='0.0.0.0', input_type=str]
        ...
        >>> EmbeddedSettings(host="localhost").host, EmbeddedSettings(host="127.0.0.2").host
        ('localhost', '127.0.0.2')
        """
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"embedded.host {host} is not a loopback address: the embedded broker and Redis have no "
                "authentication nor TLS and listen on 127.0.0.1 only; for servers other hosts can reach, run "
                "your own and set KAFKA_BOOTSTRAP_SERVERS and REDIS_URL")
        return host


class RedisClientSettings(BaseModel):
    """How every Redis client connects (services/redis_client.py builds them all); where Redis
    is, with its user and password, is ``REDIS_URL`` (``redis://user:pass@host:6379/0``;
    ``rediss://`` for TLS)."""

    # A Redis Cluster: REDIS_URL names any one node, the client finds the others and their slots.
    cluster: bool = False
    # TLS (rediss:// only): the CA bundle that signed the server's certificate (unset: the
    # system's), and a client certificate and key where the server asks for one.
    ssl_ca_certs: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None


class ReplaySettings(BaseModel):
    """``driftline replay``: MovieLens as a live product would emit it."""

    dataset: str = "ml-1m"
    # Event-time speed-up: 600 means ten minutes of data per second. 0 means as fast as possible.
    speed: NonNegativeFloat = 600.0
    # Actions follow their impression after a log-normal delay (seconds): median ~20 s, long tail
    # to minutes, so some actions arrive after later impressions.
    action_delay_median_s: PositiveSeconds = 20.0
    action_delay_sigma: NonNegativeFloat = 1.2
    action_delay_max_s: Seconds = 900.0
    seed: NonNegativeInt = 7
    limit: int | None = None
    # The traffic driver appends the request id of every /rank answered 200 here, one per line
    # (unset: nowhere): what `make chaos` checks against the features topic.
    answered_log: Path | None = None


class JoinerSettings(BaseModel):
    """The online joiner (features ⋈ actions -> examples)."""

    window_seconds: PositiveSeconds = 900.0
    # How far behind the action watermark an action may be and still count as on time.
    allowed_lateness_seconds: Seconds = 5.0
    # How long (event time) an action waits for its feature log before it is dropped as an orphan
    # (None: window + lateness + retention, see `orphan_after_seconds`).
    orphan_grace_seconds: Seconds | None = None
    # How long a closed impression is remembered to recognise late actions (None: the window).
    late_retention_seconds: Seconds | None = None
    negative_sample_rate: SampleRate = 0.25
    # Per-slice negative rates, the slice being the serving model_id; others use the default.
    slice_sample_rates: dict[str, SampleRate] = Field(default_factory=dict)
    seed: NonNegativeInt = 7
    # "immediate": a positive is emitted as soon as it joins; "window_close": when its window closes.
    positive_emit: PositiveEmit = "immediate"
    # With "immediate": the label (a label_map value) whose join emits the impression at once, the
    # one the model learns (a project file sets it to its [model] label); the other labels join it
    # until then, and an impression without it is emitted when its window closes, with every label
    # it has. None: any label's join. (A purchase model whose purchases follow clicks would
    # otherwise get each clicked impression at the click, purchase = 0, and the purchase dropped.)
    immediate_label: str | None = None
    cache_size: Count = 200_000
    spill_after_seconds: Seconds = 120.0
    late_policy: LatePolicy = "drop"
    label_map: LabelMap = Field(default_factory=lambda: {"click": "click", "like": "like"})
    batch_size: Count = 2_000
    batch_timeout_s: Seconds = 0.2
    # A joiner worker's local state directory, rocksdb://<path> (its Faust tables' RocksDB; one per
    # worker); None means rocksdb://<var_dir>/joiner/faust.
    store_url: str | None = Field(None, pattern=r"^rocksdb://.+")
    # The Faust joiner's app id: its consumer group and the prefix of its changelog topic.
    group_id: str = "driftline-joiner"
    # Workers that follow each partition's changelog to take it over quickly.
    standby_replicas: NonNegativeInt = 1
    # The Faust joiner's group liveness: a killed worker's partitions move after its session
    # times out (the takeover waits that out). Shorter than kafka.session_timeout_ms: Faust
    # heartbeats from its consumer thread, so a long batch does not miss heartbeats.
    session_timeout_ms: Count = 6_000
    heartbeat_interval_ms: Count = 1_000
    # A worker that has waited this long for a group assignment (at start or after a rebalance
    # began) exits with code 4 to be restarted: a join that never completes was seen on tansu
    # (joiner/README.md). Well above a normal join (session timeout + tansu's slow first join).
    join_timeout_s: PositiveSeconds = 60.0
    # Live traffic only: when an actions partition has been idle this many wall seconds, advance
    # its watermark to the features watermark minus the margin so windows close. None: off (a
    # replay's result then depends only on the data).
    idle_advance_seconds: PositiveSeconds | None = None
    idle_advance_margin_seconds: Seconds = 60.0
    # A partition's watermark is the (k+1)-th largest distinct event time seen on it, so k
    # far-off events (a bad client clock) cannot close every window; windows close k events later.
    watermark_outliers: NonNegativeInt = 2
    # The examples a worker produced stay this long in its local spool (joiner/output_spool.py,
    # beside its state store) to be produced again into a broker whose data was reset: the dumper
    # and the trainer may not have read them. Within dumper.dedup_min_wall_s, so the dumper
    # recognises the copies it has; the trainer's dedup window does too.
    output_retention_s: Seconds = 600.0
    # Bytes that spool may hold; when full, the oldest examples go before their retention ends.
    output_spool_max_bytes: NonNegativeInt = 256 << 20

    @model_validator(mode="after")
    def _immediate_label_is_a_label(self) -> JoinerSettings:
        if self.immediate_label is not None and self.immediate_label not in self.label_map.values():
            raise ValueError(f"immediate_label {self.immediate_label!r} (a project file's [model] label) is no "
                             f"label_map value ({sorted(set(self.label_map.values()))}): map an action type to "
                             "it ([labels])")
        return self

    @property
    def retention_seconds(self) -> float:
        """How long a closed impression is remembered: ``late_retention_seconds``, else the window.

        >>> JoinerSettings(window_seconds=60).retention_seconds
        60.0
        """
        return self.window_seconds if self.late_retention_seconds is None else self.late_retention_seconds

    @property
    def refused_after_seconds(self) -> float:
        """How far behind its partition's features a feature log is refused (``expired_impressions``):
        window + lateness + retention.

        >>> JoinerSettings(window_seconds=60, allowed_lateness_seconds=5).refused_after_seconds
        125.0
        """
        return self.window_seconds + self.allowed_lateness_seconds + self.retention_seconds

    @property
    def orphan_after_seconds(self) -> float:
        """How long an action waits for its feature log: ``orphan_grace_seconds``, else
        :attr:`refused_after_seconds`.

        Waiting that long means a click is never dropped while its feature log can still be
        joined: a feature log that comes later than the grace but within the refusal distance (one
        serving replica's spool shipping minutes behind the others') would otherwise be joined
        without its click and emitted as a negative. Past the refusal distance the feature log is
        refused and its clicks are orphans: counted, nothing emitted with a wrong label.

        >>> JoinerSettings(window_seconds=60, allowed_lateness_seconds=5).orphan_after_seconds
        125.0
        >>> JoinerSettings(orphan_grace_seconds=300).orphan_after_seconds
        300.0
        """
        return self.refused_after_seconds if self.orphan_grace_seconds is None else self.orphan_grace_seconds


class DumperSettings(BaseModel):
    """``python -m joiner.dumper``: the ``examples`` topic -> Parquet."""

    # A flush writes the buffered rows when this many are buffered or the oldest waited this long.
    flush_rows: Count = 100_000
    flush_interval_s: PositiveSeconds = 30.0
    # Event-time seconds a written example id is remembered for de-duplication; None: derived
    # from the joiner's windows (joiner.dumper.default_dedup_horizon_s).
    dedup_horizon_s: float | None = None
    # ... and wall seconds at least: copies that come back through wall-clock processes (producer
    # retries, restarts, serving's re-ship after a broker reset: serving.spool_retention_s) are
    # bounded in wall time, not in event time, and a fast replay crosses the event-time horizon
    # in well under a second.
    dedup_min_wall_s: Seconds = 900.0


class GBASettings(BaseModel):
    """``trainer.dist_mode = "gba"`` (trainer/dist/gba.py, trainer/dist/gba_model.py)."""

    # Examples an owner aggregates before it applies them once (0: sync's global batch,
    # nproc x batch_size: the same learning rates then fit both modes).
    global_batch: NonNegativeInt = 0
    # Global steps a gradient may lag its owner before it is dropped (weighted 1/s from s = 2).
    max_staleness: NonNegativeInt = 8
    # Before a pull, wait up to this x the rank's own step for the global batch its last push
    # joined (fresh parameters with no straggler, as in sync; 0: the paper's free-running GBA).
    fresh_wait: NonNegativeFloat = 1.5
    # dist_mode "auto": a rank whose work in a round (its step less its waits in collectives)
    # is over this x the median of the other ranks' is a straggler (trainer/dist/mode_switch.py).
    straggler_ratio: float = Field(2.0, gt=1)
    # dist_mode "auto": seconds a straggler must stay (sync -> gba), and stay gone (gba -> sync),
    # before the group switches: a slow step or two (a GC, a snapshot) is not worth a switch.
    switch_after_s: PositiveSeconds = 5.0


# "RANK:FACTOR" or "RANK:FACTOR:FROM-UNTIL", FACTOR >= 1, or "" (trainer/dist/straggler.py parses it)
SlowRank = Annotated[str, Field(pattern=r"^([0-9]+:[1-9][0-9]*([.][0-9]*)?(:[0-9]+-[0-9]+)?)?$")]


class TrainerSettings(BaseModel):
    """The online trainer."""

    model: str = "deepfm"
    group_id: str = "driftline-trainer"
    # the served model (sequential first-order weights and embeddings) tuned best at 2048
    # examples a step, within 0.0003 AUC of 1024 and 4096: docs/results.md, "How settings were chosen"
    batch_size: Count = 2048
    batch_timeout_s: Seconds = 0.2
    # Seconds between sparse deltas (rows), and between dense ones (the head's weights).
    sync_interval_s: PositiveSeconds = 10.0
    dense_sync_interval_s: PositiveSeconds = 3600.0
    snapshot_interval_event_s: Seconds = 86_400.0
    # Snapshots live under <var_dir>/snapshots/<model_id> unless set.
    snapshot_dir: Path | None = None
    # example_ids remembered for de-duplication (the joiner delivers at least once).
    dedup_window: NonNegativeInt = 200_000
    # Seconds between broker-epoch checks (a reset of the broker's data) while no offsets are
    # committed; a busy trainer also checks before every commit (~1 ms each).
    epoch_check_interval_s: PositiveSeconds = 0.5
    # Half-life, in negative examples (per slice, and over all slices for the global rate), of the
    # sample rates the trainer records (trainer/sample_rates.py): how fast the recorded rate
    # follows a changed joiner setting. ~25 batches of negatives: about as fast as the model's own
    # bias moves to the new mix; under a constant setting the rate is exact whatever the value.
    sample_rate_half_life: PositiveFloat = 50_000.0
    # Half-life, in examples, of the trainer's *recent* scores (trainer/learned.py): the progressive
    # AUC of the model and of its counting baselines over the recent examples
    # (driftline_trainer_recent_auc), and of the baseline that counts recent clicks alone
    # (scorer="recent_counts"). The lifetime AUC (driftline_trainer_auc) hardly moves once the
    # stream is long; this one shows a change in the traffic within about a half-life. 20,000:
    # `make bench-drift` flags the served model behind counting recent clicks after its shop's
    # change and never before it (10,000: false alarms before; 50,000: counting that slowly trails
    # the model too), and on ml-1m's million ratings it never does (20,000 or 50,000).
    recent_half_life: float = Field(20_000.0, ge=1_000)
    # Ranks of distributed training on this machine (trainer/dist/rank_trainer.py, docs/scale-out.md):
    # 1 is one trainer process owning every shard; N > 1 starts N ranks through torch's elastic
    # launcher, rank r owning shard r of every table and the partitions p with p % N == r.
    nproc: Count = 1
    # "sync" or "hybrid" (trainer/dist/model.py), "gba" or "async" (trainer/dist/gba_model.py:
    # steps not in lockstep, gradients aggregated to the global batch per token / applied on
    # arrival; the online ranks' rounds still are, docs/scale-out.md); "auto": sync, switching to
    # gba while a rank straggles (trainer.gba.straggler_ratio, switch_after_s) and back when it
    # recovers (trainer/dist/mode_switch.py). A running group also switches at a snapshot when the
    # project file's dist_mode changed. staleness (hybrid): steps of sparse updates a
    # looked-up row may miss, the updates overlapping the next steps; 0: none missed (sync's
    # results), a round's update overlapping the next round's poll and decode (docs/scale-out.md).
    dist_mode: Literal["sync", "hybrid", "gba", "async", "auto"] = "sync"
    staleness: NonNegativeInt = 1
    gba: GBASettings = GBASettings()
    # A TEST KNOB, "RANK:FACTOR" ("" none): that rank sleeps (FACTOR - 1) x its own step time after
    # each step, a straggler on purpose (trainer/dist/straggler.py; bench/bench_gba.py, the online
    # ranks); "RANK:FACTOR:FROM-UNTIL": only after that rank's steps FROM to UNTIL - 1.
    debug_slow_rank: SlowRank = ""
    # Pin each rank (and its threads: gloo's, the lookup thread) to its own share of this
    # machine's cores (local rank r of N: the r-th of N equal slices): for a machine given over
    # to the ranks, where the scheduler otherwise moves ranks onto one core now and then and the
    # others wait for them in every collective (trainer/dist/launch.py, docs/scale-out.md).
    pin_cores: bool = False
    # Times the elastic launcher restarts the whole group after a rank failed (kill -9 included)
    # before it gives up (then `driftline up`'s supervisor restarts the launcher).
    max_restarts: NonNegativeInt = 3
    # Seconds a collective waits for a rank that does not arrive before it fails: bounds a hang
    # on a rank stuck outside the step (a dead rank's peers fail at once, its socket closes).
    collective_timeout_s: PositiveSeconds = 120.0
    # Rank r > 0 exports its /metrics on metrics_port + r * rank_metrics_port_stride (rank 0 on
    # metrics_port): ports next to the trainer's belong to other services under `driftline up`.
    rank_metrics_port_stride: Count = 100
    # Where the dense head, its optimizer and the pooling run (trainer/device.py): "cpu", or
    # "cuda" / "cuda:N" where torch sees that GPU. The PS tables stay on the host either way.
    device: TorchDevice = "cpu"
    # Rows of each embedding table kept on the device with their optimizer state and stepped there
    # (trainer/mixcache.py, the MixCache; SGD or Adagrad tables without TTL, a model with
    # sequential off); 0: none. A row enters after cache_admit_after steps that missed it; the
    # least recently used leaves. Rows are written back before every delta and snapshot.
    cache_rows: NonNegativeInt = 0
    cache_admit_after: Count = 2
    # Read the next batch (its PS lookup, on CUDA its copy to the device on a second stream) while
    # the current one trains (trainer/prefetch.py; results equal bit for bit). None: on for CUDA,
    # off on the CPU, where it measured ~15% slower (the re-read of rows the step changed costs
    # more than the lookup it hides, and its thread takes the core decoding the next batch).
    lookahead: bool | None = None


class ServingSettings(BaseModel):
    """The ranking API."""

    host: str = "127.0.0.1"
    port: Port = 8000
    max_candidates: Count = 1_000
    # Largest FeatureLog (encoded, + its request-id key) /rank logs; a larger one is a 413. A bit
    # under Kafka's default message.max.bytes (1,048,588), so a logged request always fits the
    # topic; the feature-log producer's max_request_size follows it.
    feature_log_max_bytes: Count = 1_000_000
    # The lz4 level of the serving process's producer batches (services.aiokafka_quirks.set_lz4_level (quirk 2); aiokafka
    # uses 9): 1 costs ~0.01 ms per /rank's feature log on the event loop instead of ~0.07 ms
    # (0.2-0.3 ms for a 6 KB log alone), for batches ~15% larger. None: aiokafka's.
    feature_log_lz4_level: int | None = 1
    # Seconds a feature-log send may wait for the broker before it is retried.
    feature_log_send_timeout_s: PositiveSeconds = 2.0
    # The feature-log spool (services/spool.py): None means <var_dir>/serving/spool-<port>, stable
    # across restarts so a restarted replica ships what it left.
    spool_dir: Path | None = None
    # Bytes of FeatureLogs the spool may hold; when unshipped ones fill it, /rank answers 503.
    spool_max_bytes: NonNegativeInt = 1 << 30
    # Shipped FeatureLogs are kept this long to re-ship after a broker reset (the joiner's window).
    spool_retention_s: Seconds = 900.0
    # fsync every spooled FeatureLog: survives a machine crash, not only a process kill, at a few
    # ms per /rank instead of ~10-30 us.
    spool_sync: bool = False
    # A clean stop ships the spool this long at most; what is left ships at the next start.
    spool_drain_timeout_s: Seconds = 5.0
    # Seconds between reconnect attempts of the feature-log producer while Kafka is down.
    kafka_retry_s: PositiveSeconds = 2.0
    # "fm" (built-in FM), a trainer model name ("deepfm", "lr") or a ModelConfig JSON path;
    # None means the trainer's model (Settings.serving_model). The newest snapshot under
    # Settings.snapshot_root bootstraps it.
    model: str | None = None
    model_id: str = "deepfm"
    # Embedding dimension of the built-in FM model.
    embedding_dim: Count = 8
    redis_prefix: str = "driftline"
    # The feature store's connection pool, per process: at most feature_store_connections
    # connections; a /rank that finds none free waits up to feature_store_wait_s for one. A /rank
    # whose features cannot be read (Redis down, or this wait exhausted under overload) is a 503
    # with Retry-After, never an answer scored on default features, unless the request says
    # allow_default_features.
    feature_store_connections: Count = 100
    feature_store_wait_s: PositiveSeconds = 1.0
    # Seconds between reads of the feature store's load marker: a store emptied after a load (a
    # Redis restart without persistence) marks /rank answers degraded (serving/store_watch.py).
    feature_store_check_s: PositiveSeconds = 1.0
    # A /rank or action without event_time_ms gets the newest event time a request of this
    # process carried within the last event_clock_s of wall time (a replay's data time), else
    # now: it cannot move the joiner's watermarks past the traffic's own (serving/event_clock.py).
    event_clock_s: Seconds = 300.0
    # A /rank naming a feature the model does not read: "reject" (a 422 naming it) or "ignore"
    # (dropped before scoring and logging, counted in driftline_serving_unknown_features_total).
    unknown_features: UnknownFeatures = "reject"
    # How many recent clicks per user the real-time feature keeps (0: none), and which actions count.
    recent_clicks: NonNegativeInt = 20
    click_actions: tuple[str, ...] = ("click", "like")
    # The consumer group of the real-time reader (one for all replicas: Redis is shared).
    realtime_group_id: str = "serving-realtime"
    # uvicorn worker processes of `driftline serve`. Above 1, one serving PS process consumes
    # param-deltas and keeps the tables in shared memory (serving/shared_tables.py) and the workers
    # read rows from it; 1 is the single-process path (its own tables and delta feed). The built-in
    # "fm" model always runs single-process.
    workers: Count = Field(default_factory=lambda: os.cpu_count() or 1)
    # Where the serving PS maps its tables: None means /dev/shm/driftline-serving-<port> (tmpfs, no
    # disk write-back) where /dev/shm exists, else <var_dir>/serving/ps-<port>.
    ps_dir: Path | None = None
    # Room in the PS's control file: (table, shard) entries, and bytes of its JSON state.
    ps_max_shards: Count = 256
    ps_state_bytes: Count = 1 << 20
    # Seconds between the PS's state publications when no delta arrives (readiness, staleness).
    ps_state_interval_s: PositiveSeconds = 0.5
    # /readyz turns unready (503) while deltas published on param-deltas have waited unapplied
    # for longer than this (serving fell behind its trainer), or, in a worker of a serving PS,
    # the PS has published no state for this long (it hangs: its rows no longer move).
    ready_max_behind_s: PositiveSeconds = 60.0
    # API keys (serving/auth.py): when any is set, /rank, /actions (every endpoint that changes
    # state) and the protected ones below answer only a request that sends one, as
    # `Authorization: Bearer <key>` or `X-API-Key: <key>`. Several at once, so a key can be rotated
    # (add the new one, move the clients, remove the old); clients send the first. Secret: never
    # printed with the settings.
    api_keys: list[SecretStr] = Field(default_factory=list)
    # A file of keys, one per line (a Docker or Kubernetes secret), counted with api_keys; serving
    # re-reads it when it changes, so a rotation needs no restart. Set: a key is always asked for.
    api_keys_file: Path | None = None
    # /metrics asks for a key too. Off: Prometheus scrapes it without one, and it holds counts and
    # latencies, no user's data; on, its scrape config needs the key (`authorization:`).
    protect_metrics: bool = False
    # /docs, /redoc and /openapi.json ask for a key too. Off: the schema says what the README does
    # and a browser cannot send the key to load the docs page.
    protect_docs: bool = False
    # Serve with no key on a host that is not loopback; otherwise serving refuses to start so.
    allow_anonymous: bool = False


class DiskSettings(BaseModel):
    """Free space under each service's data directory (services/disk.py)."""

    # Below this many free bytes the joiner, dumper and trainer stop taking input (it waits in
    # Kafka) until space is freed, instead of failing a write and crash-looping.
    pause_below_bytes: NonNegativeInt = 64 << 20
    # Below this many, they warn (once a minute).
    warn_below_bytes: NonNegativeInt = 512 << 20
    # How often a paused service looks again.
    check_s: PositiveSeconds = 1.0


class StatusSettings(BaseModel):
    """The live status page (``driftline status``): what it scrapes, how often, how much it keeps."""

    host: str = "127.0.0.1"
    port: Port = 8500
    scrape_interval_s: PositiveSeconds = 2.0
    # Per-target timeout of one scrape; a slower target counts as down for that round.
    scrape_timeout_s: PositiveSeconds = 1.5
    # Points kept per series (900 at 2 s: the last 30 minutes).
    history_points: int = Field(900, ge=2)
    # Rates and latency quantiles are computed over this much wall time of counter history.
    rate_window_s: PositiveSeconds = 10.0
    # "name=url" or "url" entries; empty means every service `make up` runs (driftline.stack).
    targets: list[str] = Field(default_factory=list)


#: a share strictly between nothing and everything (a split, a fraction held out)
OpenFraction = Annotated[float, Field(gt=0, lt=1)]
#: a collision rate: the share of ids that share a row, 0 for none
CollisionRate = Annotated[float, Field(ge=0, lt=1)]


class EvalSettings(BaseModel):
    """``driftline eval``: everything an experiment reads (``evaluation/``). These defaults are
    what docs/results.* come from; ``evaluation.common.smoke()`` shrinks them for the tests."""

    model_config = ConfigDict(frozen=True)

    name: str = "full"
    dataset: str = "ml-1m"
    seeds: tuple[int, ...] = Field((0, 1, 2, 3, 4), min_length=1)
    workers: Count = 2
    # model (one DeepFM for every experiment)
    dim: Count = 16
    mlp: tuple[Count, ...] = (128, 64)
    sparse_lr: PositiveFloat = 0.05
    batch_size: Count = 1024
    # collisions
    coll_limit: Count | None = None  # first N ratings in time order (None: all)
    coll_test_fraction: OpenFraction = 0.1
    coll_epochs: Count = 10
    coll_user_rate: CollisionRate = 0.0773  # the paper's ml-25m rates
    coll_item_rate: CollisionRate = 0.0286
    coll_harsh_factor: PositiveFloat = 4.0  # harsher arm: this many times the paper's rates
    #: seeds of the collisions runs (None: ``seeds``); ten because a run is cheap (ids only) and the
    #: effect at the paper's rates is small next to seed noise, so its std needs a firmer estimate
    coll_seeds: tuple[int, ...] | None = Field(tuple(range(10)), min_length=1)
    # the collisions DeepFM (its own model: see collisions.py for why it differs from the others)
    coll_slots: tuple[str, ...] = Field(("user_id", "item_id"), min_length=1)
    coll_dim: Count = 16
    coll_mlp: tuple[Count, ...] = (128, 64)
    coll_sparse_lr: PositiveFloat = 0.005
    coll_init_acc: NonNegativeFloat = 0.0  # Adagrad initial_accumulator_value of the sparse tables
    coll_dense_lr: PositiveFloat = 1e-3
    coll_val_fraction: OpenFraction = 0.1  # tuning: the last share of the train part is the validation set
    # online (Algorithm 1)
    online_limit: Count | None = None
    online_batch_fraction: OpenFraction = 0.7
    online_batch_epochs: Count = 1
    online_shards: tuple[Count, ...] = Field((10, 50, 100), min_length=1)
    # staleness
    stale_shards: Count = 50
    stale_k: tuple[NonNegativeInt, ...] = Field((0, 1, 5, 10), min_length=1)  # k = 0: restore only (control)
    # baselines
    base_limit: Count | None = 300_000
    # cold start (evaluation/coldstart.py, the same stream): the share of it that stands for the
    # batch data; cold users and items are those it never saw
    cold_split: OpenFraction = 0.5
    base_offset: NonNegativeInt = 0
    base_batch_size: Count = 64  # online mini-batch for the from-scratch stream
    base_sparse_lr: PositiveFloat = 0.05  # DeepFM's sparse Adagrad lr on the stream (tuned: evaluation/tune.py)
    river_lr: PositiveFloat = 0.1  # River LR's SGD lr (tuned)
    base_lr_lr: PositiveFloat = 0.3  # driftline LR's Adagrad lr (tuned)
    base_lr_batch: Count = 32  # driftline LR's mini-batch in the model-matched comparison
    #: driftline LR's speed/quality curve: (mini-batch, Adagrad lr tuned for it)
    base_lr_curve: tuple[tuple[Count, PositiveFloat], ...] = ((32, 0.3), (64, 0.3), (128, 0.3), (256, 0.3), (1024, 0.2), (4096, 0.3))
    #: driftline's sequential LR (ModelConfig.sequential: per-example updates inside each mini-batch)
    base_lr_seq_batch: Count = 1024
    base_lr_seq_lr: PositiveFloat = 0.3  # its Adagrad lr (tuned)
    #: the served model's first-order Adagrad lr (trainer.config.deepfm_config's defaults: DeepFM
    #: with sequential first-order weights and embeddings, at the live trainer.batch_size; tuned;
    #: its embeddings take base_sparse_lr)
    base_linear_lr: PositiveFloat = 0.3
    #: the counting baseline's smoothing: a user's (item's) click rate is (clicks + m * global rate)
    #: / (examples + m), m = count_prior (tuned); the online trainer's live baseline takes it too
    count_prior: NonNegativeFloat = 10.0
    #: data sets the baselines also run on, each whole, with the settings tuned on ml-1m: the served
    #: model, the DeepFM at batch_size, the sequential LR and the counts
    base_other_datasets: tuple[str, ...] = ("ml-100k",)
    base_other_limit: Count | None = None  # their first N ratings (None: all)
    tune_base_limit: Count = 100_000  # the tuning stream: this many ratings right after the reported one
    hashed_buckets: Count = 1 << 13


#: the environment variable naming the project file (Settings.project) every ``driftline``
#: command applies (driftline/project.py)
PROJECT_VAR = "DRIFTLINE_PROJECT"


class Settings(BaseSettings):
    """All of driftline's configuration. Build it once per process with :func:`get_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="DRIFTLINE_",
        env_nested_delimiter="__",
        extra="ignore",
        populate_by_name=True,
        # (an error would otherwise print the input of the section it is in: a password with it)
        hide_input_in_errors=True,
    )

    kafka_bootstrap_servers: str | None = Field(
        default=None,
        validation_alias=AliasChoices("KAFKA_BOOTSTRAP_SERVERS", "DRIFTLINE_KAFKA_BOOTSTRAP_SERVERS"),
        description="External Kafka; unset means the embedded tansu broker.",
    )
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "DRIFTLINE_REDIS_URL"),
        description="External Redis; unset means the embedded redis-server.",
    )
    var_dir: Path = Path("var")
    # The project file (driftline.toml) every `driftline` command applies under the environment
    # (driftline/project.py); `up --config FILE` sets it for the services it starts.
    project: Path | None = None
    # The dataset cache (MovieLens for the demo): under var_dir unless set, so moving var_dir moves it.
    data_dir: Path = Field(default_factory=lambda fields: fields["var_dir"] / "data")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    metrics_port: Port = 0
    # 0.0.0.0 in containers, so Prometheus can scrape from another host.
    metrics_host: str = "127.0.0.1"

    kafka: KafkaClientSettings = KafkaClientSettings()
    redis_client: RedisClientSettings = RedisClientSettings()
    topics: TopicSettings = TopicSettings()
    embedded: EmbeddedSettings = EmbeddedSettings()
    event_time: EventTimeSettings = EventTimeSettings()
    replay: ReplaySettings = ReplaySettings()
    joiner: JoinerSettings = JoinerSettings()
    dumper: DumperSettings = DumperSettings()
    trainer: TrainerSettings = TrainerSettings()
    serving: ServingSettings = ServingSettings()
    disk: DiskSettings = DiskSettings()
    status: StatusSettings = StatusSettings()
    eval: EvalSettings = EvalSettings()

    @property
    def bootstrap_servers(self) -> str:
        """Where Kafka is: the external one if configured, else the embedded broker."""
        return self.kafka_bootstrap_servers or f"{self.embedded.host}:{self.embedded.broker_port}"

    @property
    def redis(self) -> str:
        """Where Redis is: the external one if configured, else the embedded server."""
        return self.redis_url or f"redis://{self.embedded.host}:{self.embedded.redis_port}/0"

    @property
    def log_dir(self) -> Path:
        return self.var_dir / "log"

    @property
    def serving_ps_dir(self) -> Path:
        """Where the serving PS of this port maps its tables (see ServingSettings.ps_dir)."""
        if self.serving.ps_dir is not None:
            return self.serving.ps_dir
        shm = Path("/dev/shm")
        name = f"driftline-serving-{self.serving.port}"
        return shm / name if shm.is_dir() else self.var_dir / "serving" / f"ps-{self.serving.port}"

    @property
    def snapshot_root(self) -> Path:
        """Where the trainer writes snapshots (one folder per model id) and serving finds them."""
        return self.trainer.snapshot_dir or self.var_dir / "snapshots"

    def model_snapshots(self, model_id: str) -> Path:
        """One model's snapshot folder (``LATEST`` and its snapshots): the one place it is composed.

        >>> Settings(var_dir=Path("v")).model_snapshots("deepfm")
        PosixPath('v/snapshots/deepfm')
        """
        return self.snapshot_root / model_id

    @property
    def serving_model(self) -> str:
        """The model serving runs: its own setting, else the trainer's."""
        return self.serving.model or self.trainer.model

    @property
    def serving_spool_dir(self) -> Path:
        """The replica's feature-log spool: one per port, found again by a restart.

        >>> Settings(var_dir=Path("v")).updated(serving={"port": 8001}).serving_spool_dir
        PosixPath('v/serving/spool-8001')
        """
        return self.serving.spool_dir or self.var_dir / "serving" / f"spool-{self.serving.port}"

    def updated(self, **sections: dict[str, Any]) -> Settings:
        """A copy with some fields of the named sections replaced: how code that runs a service
        with other values (a test, a benchmark, a command-line flag) passes them, instead of
        constructor arguments that shadow the settings. The new values are validated as the
        environment's are (a command-line flag is an edge too), so code reading a setting can
        trust it whichever way it came.

        >>> s = Settings().updated(trainer={"batch_size": 64}, dumper={"flush_rows": 10})
        >>> s.trainer.batch_size, s.dumper.flush_rows, Settings().trainer.batch_size
        (64, 10, 2048)
        >>> Settings().updated(trainer={"batch_size": 0})
        Traceback (most recent call last):
        ...
        pydantic_core._pydantic_core.ValidationError: 1 validation error for Settings
        trainer.batch_size
          Input should be greater than or equal to 1 [type=greater_than_equal, input_value=0, input_type=int]
        ...
        """
        out = {}
        for name, fields in sections.items():
            section = getattr(self, name)
            try:
                out[name] = type(section).model_validate({**section.model_dump(), **fields})
            except ValidationError as err:  # located from the top, as the environment's: trainer.batch_size
                raise _from_the_top(name, err) from None
        return self.model_copy(update=out)


def _from_the_top(section: str, err: ValidationError) -> ValidationError:
    """``err`` of one section's model as the :class:`Settings`' own (its locations start at ``section``)."""
    details: list[InitErrorDetails] = []
    for e in err.errors():
        d: InitErrorDetails = {"type": e["type"], "loc": (section, *e["loc"]), "input": e["input"]}
        if "ctx" in e:
            d["ctx"] = e["ctx"]
        details.append(d)
    try:
        return ValidationError.from_exception_data("Settings", details)
    except (KeyError, TypeError, ValueError):  # an error type pydantic cannot rebuild: the section's own
        return err


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment once."""
    return Settings()


def first_error(err: ValidationError) -> str:
    """A validation error's first complaint as ``where: why``, on one line (``(top)`` for the
    whole input).

    >>> try:
    ...     TrainerSettings(batch_size=0)
    ... except ValidationError as err:
    ...     print(first_error(err))
    batch_size: Input should be greater than or equal to 1
    """
    first = err.errors()[0]
    where = ".".join(str(x) for x in first["loc"]) or "(top)"
    return f"{where}: {first['msg'].removeprefix('Value error, ')}"


def refused_setting(err: ValueError) -> str:
    """A refused setting as one line: where, and why (a message that names the setting itself is
    not prefixed with it again).

    >>> try:
    ...     Settings(kafka={"session_timeout_ms": "soon"})
    ... except ValueError as err:
    ...     print(refused_setting(err))
    settings: kafka.session_timeout_ms: Input should be a valid integer, unable to parse string as an integer
    >>> try:
    ...     Settings(embedded={"host": "0.0.0.0"})
    ... except ValueError as err:
    ...     print(refused_setting(err)[:71])
    settings: embedded.host 0.0.0.0 is not a loopback address: the embedded
    """
    if not isinstance(err, ValidationError):
        return f"settings: {err}"
    where, _, msg = first_error(err).partition(": ")
    named = where == "(top)" or msg.startswith(where.split(".")[0] + ".")  # (the message names the setting)
    return f"settings: {msg if named else where + ': ' + msg}"
