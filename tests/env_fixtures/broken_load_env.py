"""An env whose load_environment raises."""


def load_environment(**kwargs):
    raise KeyError("missing_setting: load_environment is broken on purpose")
