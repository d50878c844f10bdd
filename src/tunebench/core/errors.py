"""The one exception type the CLI turns into a one-line message."""


class TunebenchError(Exception):
    """A problem the user can fix. The message names the problem and the fix.

    `exit_code` lets a job say why it stopped (2: bad input, 130: interrupted).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
