"""The one error type of the conversion package."""

from megatron_lns.base.errors import UserError


class ConversionError(UserError, ValueError):
    """A checkpoint, Hugging Face directory or setting that cannot be converted.

    The message is one line that names the file, tensor or setting at fault.
    """
