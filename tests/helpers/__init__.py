"""Helpers shared by the test files of every folder (not test modules: no ``test_`` prefix):
float64 references (``ce_reference``, ``distillation_reference``, ``log_probs_reference``,
``calibration_cases``), tiny models and shards (``tiny_encoder``, ``vocab_shards``), the launcher
helpers (``launch_helpers``, ``deepspeed_state``), the shared-launch plugin
(``shared_launches``) and the shared ranks of ``run_distributed`` (``pools``). Imported as
``tests.helpers.<module>``: pytest.ini's ``pythonpath = .`` puts the repository root on
``sys.path`` in the pytest process (and the spawned ranks get the same ``sys.path``); launched
processes have it first on their PYTHONPATH (``launch_helpers.launcher_env``)."""
