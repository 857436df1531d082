"""What the server and the trainers agree on, owned by the server and imported by the trainers
(issue 29 §2; never the reverse): the algorithms a job may name and each one's params
(``job_params``), what a dataset's data source may be (``data_sources``) and where a file source
may live (``data_roots``). No torch, no numpy, no SQL: the API process loads all of it
(``tests/service/test_import_boundaries.py``).
"""
