"""What the tests share: models and their single-process references (models.py, pipeline_models.py),
jobs started through `paratrain run` (launcher.py), and the repository's root."""

import os

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
