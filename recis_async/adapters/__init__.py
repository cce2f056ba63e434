"""This library's hooks inside the training loops users already run.

Each adapter publishes the lifecycle events, in the reference order, from its framework's
own callback points on a :class:`~recis_async.syncbus.SyncHookBus`, so every hook works
there unchanged:

* :mod:`recis_async.adapters.lightning`: ``RecisCallback``, a ``lightning.pytorch.Callback``
  (extra ``lightning``);
* :mod:`recis_async.adapters.transformers`: ``RecisTrainerCallback``, a
  ``transformers.TrainerCallback`` (extra ``transformers``);
* :mod:`recis_async.adapters.ignite`: ``attach(engine, hooks)`` (extra ``ignite``).

The submodules import their framework; this package imports none.
"""
