"""The private training algorithms, apart from the worker that runs them (issue 14 §2).

No module here imports the database, the API or the ledger
(``tests/service/training/test_training_boundary.py``): a trainer plans the cost of a run from
its params (``plan``), trains on data it is handed, and releases through a callback the gate
gives it. The worker (``service.worker``) does the rest.

* ``data`` — data sources named by URI (``file://….npz``, ``file://….csv``, ``builtin:digits``,
  ``builtin:permuted-digits?tasks=N``, …), parsed without reading and loaded only when called;
  the check that a source's record ids are exactly the ledger's batches. numpy only, no torch.
* ``params`` — each algorithm's job params, typed and validated (torch-free: the API checks jobs
  with it at submit time); ``algorithms`` — the algorithm names and their trainer classes.
* ``nets`` — the MLP and the small CNN; ``per_example_gradients`` — vmap'd per-example gradients.
* ``dp_sgd`` — **the DP-SGD step**, true Poisson sampling, ``DpSgdTrainer.plan`` / ``train``;
  ``adadp`` — AdaDp, the sound variant.
* ``stages`` — staged runs (one reservation per task or block); ``l2dp_ml`` with ``agem`` —
  L2DP-ML and its baselines, ``lifelong_tasks`` the task plan and accuracy matrix they share;
  ``continual_release`` — continual and sliding-window release;
  ``pretrained`` with ``feature_extractor`` — classifiers on a frozen public extractor.
"""
