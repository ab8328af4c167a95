"""The one exception type for bad user input.

Raised before expensive work starts, with a message that names the offending config key or file
and says what to do. ``train.py`` prints its message alone (no library traceback) and exits 1;
``HYDRA_FULL_ERROR=1`` shows the full traceback.
"""


class ConfigError(ValueError):
    """A config value, file or model the user pointed at is unusable; the message says the fix."""
