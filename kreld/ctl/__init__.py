"""``kreldctl``'s command line (``args``) and its text output (``render``);
the commands themselves are in ``kreld/cli.py``.

May import every folder.
"""
