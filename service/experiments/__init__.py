"""``ledger experiment lifelong|continual|pretrained|adadp``: each paper's qualitative claim, reproduced
at this machine's scale, with every private algorithm run as a job behind the release gate of an
embedded ledger (``embedded``). Each experiment writes ``report.json`` and PNG plots into its
output folder and prints a table (``report``)."""
