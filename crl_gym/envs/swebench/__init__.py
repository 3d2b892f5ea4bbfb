"""SWE-Bench environment: issue-resolving in a locked-down Docker sandbox, graded by swebench.

Modules: ``env`` (``SWEBenchEnv``, registered as ``crl/SWEBench-v0``), ``sandbox``
(``DockerSandbox``), ``tools`` (tool-call format), ``editor`` (``str_replace_editor``),
``grading``, ``tasks``, ``image``, ``filter`` and ``cli`` (``crl-swe``). Heavy imports
(docker, swebench) happen in the submodules, so importing this package is cheap.
"""
