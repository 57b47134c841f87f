"""Shared mode (`nvme.shared: true`): one budget, one LRU order and one index for every
process on a cache directory, coordinated through files below its `shared/` folder
(docs/deployment.md). `tree.SharedTree` is what the store holds."""
