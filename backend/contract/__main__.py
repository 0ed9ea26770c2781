"""`python -m backend.contract > model_repository/llm/config.pbtxt`"""

import sys

from backend.contract.tensors import render_config_pbtxt

sys.stdout.write(render_config_pbtxt())
