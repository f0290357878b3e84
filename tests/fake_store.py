"""A stand-in for the launcher's key-value store (torchrun's TCPStore), for one process
playing every rank of program.py's store-based protocols (agree(), the fault reports)."""


class FakeStore:
    """The calls program.py makes on the store, on a dict."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def append(self, key, value):
        self.data[key] = self.data.get(key, b"") + value.encode()

    def add(self, key, n):
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])

    def wait(self, keys):
        assert all(k in self.data for k in keys), "a rank would wait for the others"

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]

    def compare_set(self, key, expected, desired):
        if self.data.get(key, b"").decode() == expected:
            self.set(key, desired)
        return self.data[key]
