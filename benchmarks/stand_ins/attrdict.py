"""``attrdict.AttrDict`` for ViT's ``test_vit.py`` (``benchmarks/apps.py``): the package imports
``collections.Mapping``, which Python 3.10 removed. A dict whose keys read as attributes."""


class AttrDict(dict):
    def __getattr__(self, name):
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return AttrDict(value) if isinstance(value, dict) and not isinstance(value, AttrDict) \
            else value

    def __setattr__(self, name, value):
        self[name] = value
