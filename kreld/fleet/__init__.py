"""A fleet in object storage: the bucket's object names and encodings
(``objects``, with ``kernel_code_objects`` for kernel code in a batch), S3
through obstore (``s3``), the daemon's publisher (``publish``), and a bucket
read back as a boot source for ``kreldctl --from`` (``bucket``).

May import everything below ``server`` and ``server`` itself.
"""

__all__: list[str] = []  # a folder: import its modules by name
