"""The commented project file a new project starts from (``driftline.toml``), as ``driftline init
[PATH]`` writes it (:func:`write_template`; the command is in :mod:`driftline.cli`).

The file is valid as written (a small click model over a few example features); every section
says what it does and which setting it replaces. ``driftline init --schema`` prints the JSON
schema of the format instead (:func:`driftline.project.json_schema`), for editors.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "driftline.toml"
>>> write_template(path) == path, load_project(path).name
(True, 'my-model')
"""

from __future__ import annotations

from pathlib import Path

from driftline.project import ProjectError, load_project  # noqa: F401 - load_project: the doctest

TEMPLATE = '''\
# driftline project file: your features, model, labels and stream settings in one place.
# Start the stack with it:   driftline up --config driftline.toml
# Check it:                  driftline init --check driftline.toml
# Schema for editors:        driftline init --schema > driftline.schema.json
# Every key here maps onto a setting (README, "Configuration"); an environment variable
# (DRIFTLINE_<SECTION>__<KEY>) still wins over this file. A key left out keeps the setting's default.

# The model id: snapshots (<var>/snapshots/<name>), metrics and serving's slice are named after it.
name = "my-model"

# A /rank naming a feature the model does not read: "reject" (422 naming it) or "ignore"
# (dropped and counted in driftline_serving_unknown_features_total).
unknown_features = "reject"

# ---------------------------------------------------------------------------------------------
# Features: one [[features]] block per feature the model reads.
#   source = "context"    sent once per /rank request:   {"context": {"sparse": {"device": ["ios"]}}}
#            "candidate"  sent per candidate:            {"candidates": [{"item_id": 7, "features": ...}]}
#            "user"/"item" looked up in the feature store (Redis) by the request's user_id / item_id,
#                         filled by `driftline features load --config driftline.toml --users/--items FILE`
#            "position"   where a candidate is shown (0 = first; one feature at most): serving scores
#                         every candidate at 0, answers them ranked, and logs each at the place it
#                         answered it at; a candidate that gives its own (a replayed log) keeps it
#   kind   = "sparse" (ids, embedded) or "dense" (a float, fed to the MLP / linear head)
#   ids    = "int" (int64 ids as they are) or "string" (hashed: services/hashing.py string_id)
#   table  = share an embedding table with other features (default: a table of its own)
#   pooling = "sum" or "mean" over a bag of several ids (default: [model] pooling)
# Serving adds user_id / item_id / recent_items only when declared here (source "context"/"candidate").
# ---------------------------------------------------------------------------------------------
[[features]]
name = "device"
source = "context"
ids = "string"

[[features]]
name = "item_id"
source = "candidate"

[[features]]
name = "position"
source = "position"

[[features]]
name = "category"
source = "item"
ids = "string"

[[features]]
name = "price"
source = "candidate"
kind = "dense"

# ---------------------------------------------------------------------------------------------
# Tables: [tables.default] applies to every table; [tables.<name>] overrides one (a feature's
# embedding table is named like the feature, its first-order table "<name>_w").
#   dim          embedding size (deepfm: one dim for all fields, from [model] dim)
#   optimizer    {kind = "adagrad"|"adam"|"sgd"|"ftrl", lr = ...}; an adagrad's max_accumulator = 30
#                keeps a busy row's step from shrinking for ever: the model follows traffic whose
#                appeal changes faster, at a small cost where nothing changes (make bench-drift; the
#                status page says when the model trails counting recent clicks). Its
#                initial_accumulator_value, left out, is 0.001 for embeddings that learn example by
#                example (the default): a new row's first steps then keep to their gradients' size,
#                so rare clicks' many non-clicks do not shake it (make bench-worlds); else 0
#   admission    an unseen id gets a row on its min_count-th occurrence, with this probability
#   ttl_seconds  rows not seen for this long (event time) are dropped
# ---------------------------------------------------------------------------------------------
[tables.default]
optimizer = { kind = "adagrad", lr = 0.05 }
admission = { min_count = 1, probability = 1.0 }
# ttl_seconds = 604800

# [tables.item_id]
# admission = { min_count = 3 }

# ---------------------------------------------------------------------------------------------
# The model: "deepfm" (linear + FM + MLP) or "lr" (logistic regression).
#   fields / linear / dense: which features feed the embedding fields, the first-order terms and
#   the dense inputs; left out: every sparse feature (fields, linear; a position: linear only),
#   every dense one (dense).
#   pooling: how a feature's bag of several ids (tags, recent items) pools when the feature names no
#   pooling of its own: "mean" (safer: measured on bags of 1-300 tags, AUC 0.606 against 0.562
#   where clicks follow the tags' mean effect, 0.589 against 0.596 where they follow their sum) or
#   "sum"; left out: "sum"
#   dense_scaling: how the dense inputs are put on one scale, so their unit does not matter (cents or
#   dollars): "log" (signed log1p, then standardized by the stream's running statistics; for
#   prices, counts, durations), "standard" (standardized only), "none" (as they come)
#   sequential: the first-order weights learn example by example inside each mini-batch, so a
#   user's or item's burst is scored with what its earlier examples taught (false: once per batch)
#   sequential_embeddings: with sequential, a deepfm's embedding rows learn that way too (its
#   tables then need "sgd" or "adagrad"; false: the embeddings step once per batch)
#   linear_scale: a deepfm learns a factor on each first-order field, so a feature whose values say
#   nothing of the label (a zip code, a device model, drawn at random) is shrunk toward 0 instead of
#   adding noise (false: every first-order field counts 1)
#   linear_optimizer: the first-order tables' optimizer (they take a larger step than embeddings;
#   the initial accumulator keeps a new id's first Adagrad steps from swinging its weight;
#   max_accumulator = 30 here too, where a busy item's accumulator grows fastest)
#   meta: meta-learned starting points for new ids of one feature (a new user's first steps):
#   meta = { task_slot = "user_id" } (support, query, ... : trainer/meta.py; one trainer process)
#   content: a content encoder over a sparse feature holding each item's content tokens (title
#   words, ...), whose output joins the item's embedding (the feature is no field of its own):
#   content = { slot = "title_words", item_slot = "item_id" } (buckets, token_dim, hidden: trainer/content.py)
# ---------------------------------------------------------------------------------------------
[model]
kind = "deepfm"
dim = 8
mlp = [32, 16]
label = "click"
sequential = true
sequential_embeddings = true
linear_scale = true
linear_optimizer = { kind = "adagrad", lr = 0.3, initial_accumulator_value = 0.3 }
# fields = ["device", "item_id", "category"]     (a position is a first-order term unless listed here)
# dense = ["price"]
pooling = "mean"
dense_scaling = "log"
# meta = { task_slot = "item_id" }

# Action types (POST /actions "action_type") -> the label they set. Default: click->click, like->like.
# An impression goes to the trainer when [model] label joins it (the other labels it has by then
# ride along; without it, at its window's close): with purchase = "purchase" and label =
# "purchase", a purchase after the click is in the example.
[labels]
click = "click"
# purchase = "purchase"

# The joiner keeps this share of negatives (impressions without a click); the trainer corrects.
[sampling]
negative_rate = 0.25
# per_model = { "my-model" = 0.5 }

# Join windows (seconds). An action counts for an impression up to window_seconds after it (a later
# one is late: dropped, counted); a label that comes long after the impression (a purchase hours
# after the click) needs a window that long, at the cost of examples reaching the trainer that much
# later when that label never comes. Live traffic with sparse clicks leaves partitions idle:
# idle_advance_seconds moves their watermark on after that many wall seconds so windows close.
[windows]
window_seconds = 900
allowed_lateness_seconds = 5
idle_advance_seconds = 30

# How often the trainer publishes deltas to serving (sparse rows; dense weights after 10, 20, 40 s...).
[sync]
sparse_interval_s = 10
dense_interval_s = 60

# `driftline features load --config driftline.toml`: the key columns of your users/items files.
[store]
user_key = "user_id"
item_key = "item_id"
# separator = "|"      # split string cells into bags of ids
movielens = false      # true loads the MovieLens demo's features (the demo's file only)
# users_file = "users.parquet"   # `up` loads these into Redis, and again whenever Redis loses them
# items_file = "items.csv"       # (relative to this file; `features load --config` loads them too)

# Start from a model trained on your history: Parquet examples in the dumper's layout.
[warm_start]
kind = "none"
# kind = "examples"
# examples_dir = "history/"

# Any other setting, by section (README, "Configuration"):
# [settings.event_time]
# max_past_s = 2592000     # accept events up to 30 days old (replaying an old log)
'''


def write_template(path: Path, force: bool = False) -> Path:
    """Write :data:`TEMPLATE` to ``path`` (refusing to overwrite unless ``force``)."""
    path = Path(path)
    if path.exists() and not force:
        raise ProjectError(f"{path} exists (--force overwrites it)")
    path.write_text(TEMPLATE)
    return path
