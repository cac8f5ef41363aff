"""Shared fixtures: a real tansu broker and a real redis-server on free ports, one per session.

Tests that need Kafka or Redis take ``broker`` / ``redis_url`` / ``settings``; nothing is mocked.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from driftline.embedded import redis_command, tansu_command, wait_for_port
from services.ports import free_port
from services.settings import Settings


def _start(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    out = open(log_path, "ab")
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Broker:
    """A running tansu broker; ``restart()`` wipes its memory storage, like a real tansu restart."""

    def __init__(self, log_dir: Path) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.log_path = log_dir / f"tansu-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self.proc = _start(tansu_command(self.host, self.port), self.log_path)
        wait_for_port(self.host, self.port, 20, "broker", self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


class KilledBroker(Broker):
    """``restart()`` is a kill -9 and a start, as in a crash (a clean stop waits for clients)."""

    def restart(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.start()


def killed_broker(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[KilledBroker]:
    """A test module's own broker (yield from it in a module-scoped ``broker`` fixture, which the
    ``settings`` fixture then uses): restarting it wipes only that module's topics."""
    b = KilledBroker(tmp_path_factory.mktemp(name))
    yield b
    b.stop()


@pytest.fixture(autouse=True)
def _service_logging_undone() -> Iterator[None]:
    """Undo ``services.log.setup_logging`` when a test ran a service in process (the CLI, the
    status app): its handler writes to the stream that was ``sys.stderr`` then, the test's capture,
    which pytest closes; a later test's thread logging through it prints "Logging error"."""
    root = logging.getLogger()
    level = root.level
    yield
    for handler in [h for h in root.handlers if getattr(h, "_driftline", False)]:
        root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    b = Broker(tmp_path_factory.mktemp("broker"))
    yield b
    b.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    data = tmp_path_factory.mktemp("redis")
    proc = _start(redis_command("127.0.0.1", port, data), data / "redis.log")
    wait_for_port("127.0.0.1", port, 20, "redis", proc)
    yield f"redis://127.0.0.1:{port}/0"
    _stop(proc)


@pytest.fixture
def settings(broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings pointing at the session broker, with topic names unique to this test."""
    suffix = uuid.uuid4().hex[:8]
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", broker.bootstrap)
    s = Settings(var_dir=tmp_path / "var")
    s.topics.features = f"features-{suffix}"
    s.topics.actions = f"actions-{suffix}"
    s.topics.examples = f"examples-{suffix}"
    s.topics.param_deltas = f"param-deltas-{suffix}"
    s.topics.dead_letters = f"dead-letters-{suffix}"
    s.joiner.group_id = f"driftline-joiner-{suffix}"
    return s


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MB tmpfs of the test's own, to fill: a full disk without filling the machine's
    (mounting one needs root: the test is skipped without)."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def fill_disk(path: Path, leave_bytes: int) -> Path:
    """Fill the file system under ``path`` until ``leave_bytes`` are free; delete the file to free it."""
    fill = path / "fill"
    with open(fill, "wb") as f:
        st = os.statvfs(path)
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - leave_bytes)
    return fill


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


# The test files that share tests/test_loop.py's ``loop_stack`` (one ``driftline up`` replaying
# MovieLens): they run one after the other on one worker, and the stack stops after the last of
# them. Left up until the session's end, it took most of a core from every later test on that
# worker (a full suite here: 23 min, and timed waits in other files failed).
LOOP_STACK_FILES = ("tests/test_loop.py", "tests/test_dashboards.py", "tests/status/test_live_loop.py")
# Run on the same worker right after them (one scheduling unit): two whole demo stacks at once on
# 2 cores (~20 processes) pushed timed waits in both past their bounds.
AFTER_LOOP_STACK = ("tests/test_compose_processes.py",)
# The longest files (a full run's durations on a 2-core machine: each 2-7 min of many processes),
# started first so the two workers finish together instead of one running them alone at the end.
LONGEST_FILES = (
    "tests/joiner/test_faust_joiner.py", "tests/trainer/distributed/test_machines.py", "tests/trainer/distributed/test_rank_failures.py",
    *LOOP_STACK_FILES, *AFTER_LOOP_STACK, "tests/trainer/distributed/test_ranks.py", "tests/test_own_data.py", "tests/trainer/test_online.py",
    "tests/joiner/test_crash.py", "tests/test_stack.py", "tests/serving/test_process.py",
)


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first, the loop-stack files together, and inside them the tests that do
    not use the stack before those that do: one between two users stops the stack, and the next
    user starts another (a stable sort: the rest keeps its order)."""
    strays = sorted({_file(i) for i in items if "loop_stack" in i.fixturenames} - set(LOOP_STACK_FILES))
    if strays:
        raise pytest.UsageError(f"{strays} use loop_stack: add them to LOOP_STACK_FILES in tests/conftest.py")
    rank = {path: n for n, path in enumerate(LONGEST_FILES)}
    first = rank[LOOP_STACK_FILES[0]]

    def key(item: pytest.Item) -> tuple[int, int, int]:
        n = rank.get(_file(item), len(rank))
        if _file(item) in LOOP_STACK_FILES:
            return first, int("loop_stack" in item.fixturenames), n
        return n, 0, 0

    items.sort(key=key)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: plain pytest runs without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` with the loop-stack files (and AFTER_LOOP_STACK) as one unit, so one
    worker runs them in a row."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoopStackTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return LOOP_STACK_FILES[0] if path in LOOP_STACK_FILES + AFTER_LOOP_STACK else path

    return LoopStackTogether(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stop the shared loop stack once the next test does not use it (its users run in a row)."""
    result = yield
    if "loop_stack" in item.fixturenames and (nextitem is None or "loop_stack" not in nextitem.fixturenames):
        from tests.test_loop import stop_shared_stack

        stop_shared_stack()
    return result


def _one_httpx_ssl_context() -> None:
    """httpx (0.28.1, pinned) parses certifi's CA bundle into a new SSL context for every client it
    builds, ~28 ms of CPU, so every ``httpx.get``/``post`` pays it: the tests' polls and request
    loops made thousands (py-spy: 11 s of CPU in one serving test's request loop). Every test talks
    plain http; the default context is built once per test process and shared (one SSLContext
    serves any number of connections). Other arguments still get their own."""
    from httpx._transports import default

    build = default.create_ssl_context
    shared = build()

    def create_ssl_context(verify: object = True, cert: object = None, trust_env: bool = True) -> object:
        if verify is True and cert is None and trust_env:
            return shared
        return build(verify=verify, cert=cert, trust_env=trust_env)

    default.create_ssl_context = create_ssl_context


def pytest_configure(config: pytest.Config) -> None:
    _one_httpx_ssl_context()
    # Numba caches compiled kernels next to the sources; keep test runs from fighting over it.
    os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parent.parent / "var" / "numba-cache"))
    # Tests move var_dir into their tmp_path, which would move the dataset cache with it (and
    # download MovieLens per test): every test and every service it starts shares the repo's.
    os.environ.setdefault("DRIFTLINE_DATA_DIR", str(Path(__file__).resolve().parent.parent / "var" / "data"))
    if not hasattr(config, "workerinput"):  # once, in the controller, before any worker starts
        _warm_numba_cache()


_WARM = """
import tempfile
from pathlib import Path

import numpy as np
from trainer.batch import SparseBatch
from trainer.config import deepfm_config, lr_config
from trainer.model import SparseModel, make_tables

models = []
for cfg in (deepfm_config(dim=4, mlp=[8]), lr_config(sequential=True)):
    rows = [{s: [i % 3] for s in cfg.all_slots} for i in range(8)]
    b = SparseBatch.from_slot_dicts(rows, slots=cfg.all_slots, labels=np.arange(8) % 2,
                                    event_time_ms=np.full(8, 1_000))
    models.append(SparseModel(cfg))
    models[-1].train_step(b)


def part(f):  # each part alone: one failing leaves the rest warmed
    try:
        f()
    except Exception as err:
        print(f"numba warm-up: {f.__name__}: {err!r}")


@part
def deltas_and_snapshots():  # the trainer's syncs and snapshots, serving's delta replicas
    from trainer import snapshots
    m = models[0]
    replicas = make_tables(m.cfg, serving=True)
    for name, t in m.tables.items():
        for chunk in t.pop_updates():
            replicas[name].apply_sync(chunk)
        t.delete(np.array([0], np.int64))
        t.expire(now=10**15)
    root = Path(tempfile.mkdtemp()) / m.cfg.model_id
    snapshots.save(root, m.cfg, m.tables, {"head": m.head.state_dict()},
                   {"offsets": {}, "sparse_version": 0, "dense_version": 0, "examples_applied": 0})
    snapshots.load(root, m.cfg, serving=True)
    snapshots.load(root, m.cfg, serving=False)


@part
def dedup_window():  # every online trainer's duplicate check
    from trainer.dedup import DedupWindow, duplicates
    w = DedupWindow(1000)
    h = np.arange(20, dtype=np.uint64).reshape(-1, 2)
    w.contains_many(h)
    duplicates(w, np.zeros((0, 2), np.uint64), h)
    w.add_many(h)


@part
def tables():  # a model stepped once per batch (packed), GBA's owners, admission, TTL, a table that grows
    from ps import AdmissionConfig, EmbeddingTable
    cfg = deepfm_config(dim=4, mlp=[8], sequential=False)
    rows = [{s: [i % 3] for s in cfg.all_slots} for i in range(8)]
    b = SparseBatch.from_slot_dicts(rows, slots=cfg.all_slots, labels=np.arange(8) % 2,
                                    event_time_ms=np.full(8, 1_000))
    SparseModel(cfg).train_step(b)
    for t in (models[0].cfg.tables[0], models[0].cfg.tables[-1]):
        tab = EmbeddingTable(t.model_copy(update={"admission": AdmissionConfig(min_count=2), "ttl_seconds": 1.0}))
        ids = np.arange(5000, dtype=np.int64)
        for _ in range(2):
            tab.gather(ids, insert=True, event_time=np.full(ids.size, 1_000))
        tab.apply_gradients(ids, np.ones((ids.size, t.dim), np.float32), np.full(ids.size, 1_000))
        tab.expire(now=10**9)


@part
def ranks():  # a distributed trainer's owners and wire
    from trainer.dist.routing import packed_rows, plan
    from trainer.sharding import shard_of
    ids = np.arange(12, dtype=np.int64)
    tab = ids % 3
    owner = shard_of(ids, 2)
    p = plan(ids, tab, owner, 2, 3)
    dims = np.array([4, 4, 1], np.int64)
    rows = packed_rows(dims, p.u_tab, p.inv, tab)
    n = int(dims[p.u_tab].sum())
    rows.sum_back(rows.take(np.ones(n, np.float32), rows.size), n)
"""


def _warm_numba_cache() -> None:
    """Compile the kernels of the served model's training, its syncs and snapshots, the dedup window,
    a model and tables stepped once per batch (GBA's owners, admission, TTL, growth) and the ranks'
    wire into the shared cache before the tests run: on a fresh clone the cache is
    empty, and every process that first needs a kernel compiles it, several at once inside timed
    waits (the sequential pass alone takes ~20 s; the rank tests ran 15-30 s longer there)."""
    subprocess.run([sys.executable, "-c", _WARM], cwd=Path(__file__).resolve().parent.parent, check=False,
                   timeout=300)
