"""Shared mode (`nvme.shared: true`): one budget, one LRU order and one index for every
process on a cache directory, coordinated through files below its `shared/` folder
(docs/deployment.md). `tree.SharedTree` is what the store holds.

The modules, each importing only those listed after it:

* `tree.py`     `SharedTree`: one member per root and the background threads;
* `member.py`   `RootMember`: this process as a member of one root (join, lease, journals
  followed, ledger followed, headroom kept ready, leave);
* `janitor.py`  cleaning up after dead and departed members, the tree walk, trimming;
* `share.py`    `Account`: making room (the pool, then evicting by claim, transfer and
  unlink), retrying, settling and tidying the ledger;
* `account.py`  `AccountBooks`: the account's books (owned, reserved, cap) in step with the
  ledger, pool claims, publishes, shared reads;
* `journal.py`, `leases.py`, `ledger.py`  the files the members share.
"""
