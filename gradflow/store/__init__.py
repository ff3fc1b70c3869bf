"""The run store: SQLite (WAL) file of runs, per-layer statistics and control requests.

TF-free: the dashboard, the CLI and the figures read it without TensorFlow.

Example:

```python
from gradflow.store import RunStore
store = RunStore()                      # $GRADFLOW_DB or ./gradflow-data/runs.db
print(store.runs()[["run_id", "name", "status"]])
```
"""

from gradflow.store.store import RunStore, UnknownRunError
from gradflow.store.tables import (
    ACTIVE_STATUSES,
    FINAL_STATUSES,
    REQUESTS,
    SCHEMA_VERSION,
    STATUSES,
    StoreGoneError,
    default_path,
)
from gradflow.store.trouble import NewerStoreError, StoreUpgradeError
from gradflow.store.writer import RunWriter

__all__ = [
    "ACTIVE_STATUSES",
    "FINAL_STATUSES",
    "NewerStoreError",
    "StoreUpgradeError",
    "REQUESTS",
    "SCHEMA_VERSION",
    "STATUSES",
    "RunStore",
    "RunWriter",
    "StoreGoneError",
    "UnknownRunError",
    "default_path",
]
