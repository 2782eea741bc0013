"""What several test files share: processes (run_module, launch_two_processes), the 3D step
against the single-device reference, compiled-HLO collective counts, kernel comparisons,
trained checkpoints. REPO is the repository's root (configs/, README.md)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
