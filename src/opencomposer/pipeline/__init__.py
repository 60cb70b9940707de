"""The whole learning job of ``opencomposer train``: tasks -> [CPT] -> SFT -> RL -> evals -> report.

``run.py`` runs the stages in order; ``report.py`` writes the run report (JSON, Markdown, a PNG).

Test: ``pytest tests/integration/test_rl_run.py tests/integration/test_pipeline_pretrain.py -q``.
"""
