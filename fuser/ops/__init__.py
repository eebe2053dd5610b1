"""Fused ops: importing this package registers every `torch.ops.fuser.*` op."""

from fuser.ops import rmsnorm  # noqa: F401
from fuser.ops import rope  # noqa: F401
from fuser.ops import gated_act  # noqa: F401
from fuser.ops import attention  # noqa: F401
from fuser.ops import linear  # noqa: F401
from fuser.ops import fp8  # noqa: F401
from fuser.ops import fp8_quant  # noqa: F401
