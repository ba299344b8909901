"""An OpenEnv environment written from OpenEnv's server template (``openenv init``'s layout:
``models.py``, ``server/<name>_environment.py``, ``server/app.py``): guess the number, plus a
server that answers in the ways a hostile one can."""
