"""MovieLens-100k as a click log of your own: ``impressions.csv``, ``users.csv``, ``items.csv``.

Each rating becomes one impression (a request of one candidate: ml-100k has no slates) at the
rating's time, clicked when the rating is at least ``--click-rating`` (4: about 55% clicked; 5:
about 21%, a sparse-click version). Users' and items' attributes go to the feature files that
``driftline features load`` reads; multi-valued genres are joined with ``|`` (the project's
``[store] separator``). Reads the Parquet files ``driftline data fetch`` writes; needs nothing but
pyarrow (in driftline's install).

    .venv/bin/driftline data fetch
    .venv/bin/python examples/ml-100k/prep.py --out var/ml-100k-log
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default="var/data/ml-100k", help="driftline data fetch's ml-100k Parquet files")
    ap.add_argument("--out", default="var/ml-100k-log", help="where the three CSV files go")
    ap.add_argument("--click-rating", type=float, default=4.0, help="a rating at least this is a click (default 4)")
    args = ap.parse_args()
    src, out = Path(args.data_dir), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    r = pq.read_table(src / "ratings.parquet").sort_by([("timestamp", "ascending")])
    clicked = pc.cast(pc.greater_equal(r["rating"], args.click_rating), pa.int8())
    pacsv.write_csv(pa.table({"user": r["user_id"], "movie": r["item_id"], "ts": r["timestamp"], "clicked": clicked}),
                    out / "impressions.csv")

    u = pq.read_table(src / "users.parquet")
    pacsv.write_csv(u.select(["user_id", "gender", "age", "occupation", "zip"]), out / "users.csv")

    i = pq.read_table(src / "items.parquet")
    genres = pa.array(["|".join(g) for g in i["genres"].to_pylist()])
    year = pc.fill_null(i["year"], 0)
    pacsv.write_csv(pa.table({"item_id": i["item_id"], "genres": genres, "year": year}), out / "items.csv")
    print(f"{out}/impressions.csv: {r.num_rows} impressions, {pc.sum(clicked).as_py()} clicked "
          f"(rating >= {args.click_rating:g}); users.csv: {u.num_rows}; items.csv: {i.num_rows}")


if __name__ == "__main__":
    main()
