"""What the project knows about a target: its checkpoint's tensor files (`files`), its embedding and
LM head, tied or not (`head`), loading it sharded or whole (`load`), the hooks on its decoder layers
(`hooks`), its KV cache for decoding (`cache`) and its decoding state with the exact rollback
(`state`).

Imports nothing, so that importing one module (the draft models import `head`) pulls in no other.
"""
