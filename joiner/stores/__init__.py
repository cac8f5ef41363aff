"""Waiting-state stores, chosen by URL: ``memory://`` (tests) or ``rocksdb://<path>`` (default):
:mod:`joiner.stores.memory`, :mod:`joiner.stores.rocksdb` (the Faust app opens the latter by
``joiner.store_url`` through :mod:`joiner.faust_store`)."""
