"""The key file's rules without a server: what a file may say, which key is whose, and what each tenant sees of the
others in `/metrics` and `/v1/models` (the server-side checks are in test_server_guards.py)."""

import hashlib
import json

import pytest

from vllm_bdlora.tenants import KeyFileError, TenantKeys, visible_metrics, visible_models

GOOD = [
    {"name": "ops", "key": "o" * 20, "admin": True},
    {"name": "acme", "key_sha256": hashlib.sha256(b"a" * 20).hexdigest(), "adapters": ["acme-*", "shared"],
     "roots": ["/srv/acme"]},
]  # fmt: skip


def test_keys_name_their_tenants_and_nothing_else_matches():
    keys = TenantKeys.parse({"tenants": GOOD}, "keys.json")
    assert keys.tenant_for(f"Bearer {'o' * 20}").admin
    acme = keys.tenant_for(f"bearer {'a' * 20}")
    assert acme.name == "acme" and not acme.admin
    for header in (None, "", "Bearer ", f"Basic {'a' * 20}", f"Bearer {'a' * 19}", "Bearer " + "o" * 21):
        assert keys.tenant_for(header) is None, header
    assert acme.may_use("acme-1") and acme.may_use("shared") and not acme.may_use("shared2")
    assert not acme.may_use("acm") and not acme.may_use("globex-acme-1")
    assert acme.may_load_from("/srv/acme/x") and not acme.may_load_from("/srv/acme/../globex/x")
    assert not acme.may_load_from("/srv/acmeevil/x")


@pytest.mark.parametrize(
    ("document", "says"),
    [
        ([], 'must hold {"tenants": [...]}'),
        ({"tenants": []}, 'must hold {"tenants": [...]}'),
        ({"tenants": [{"key": "k" * 20, "adapters": ["a"]}]}, "needs a unique, non-empty 'name'"),
        ({"tenants": [{"name": "a", "key": "short", "adapters": ["a"]}]}, "at least 16 characters"),
        ({"tenants": [{"name": "a", "key_sha256": "00", "adapters": ["a"]}]}, "'key_sha256' (64 hex)"),
        ({"tenants": [{"name": "a", "key": "k" * 20, "key_sha256": "0" * 64, "adapters": ["a"]}]}, "exactly one"),
        ({"tenants": [{"name": "a", "key": "k" * 20}]}, "a tenant key needs 'adapters'"),
        ({"tenants": [{"name": "a", "key": "k" * 20, "adapters": "a-*"}]}, "are lists of strings"),
        ({"tenants": [{"name": "a", "key": "k" * 20, "adapters": ["a b"]}]}, "is not an adapter name or prefix*"),
        ({"tenants": [{"name": "a", "key": "k" * 20, "admin": "yes"}]}, "are true or false"),
        ({"tenants": [{"name": "a", "key": "k" * 20, "admin": True, "role": "x"}]}, "unknown fields ['role']"),
        ({"tenants": [{"name": "a", "key": "k" * 20, "admin": True}, {"name": "a", "key": "j" * 20, "admin": True}]},
         "needs a unique"),
        ({"tenants": [{"name": "a", "key": "k" * 20, "admin": True}, {"name": "b", "key": "k" * 20, "admin": True}]},
         "its key is another tenant's too"),
    ],
)  # fmt: skip
def test_a_key_file_that_cannot_be_used_is_refused_naming_the_entry_and_the_fix(document, says):
    with pytest.raises(KeyFileError) as refused:
        TenantKeys.parse(document, "keys.json")
    assert says in str(refused.value) and "--tenant-keys keys.json" in str(refused.value), str(refused.value)
    assert "README" in str(refused.value)


def test_a_key_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text("{tenants: }")
    with pytest.raises(KeyFileError, match="not valid JSON"):
        TenantKeys.read(str(path))
    with pytest.raises(KeyFileError, match="cannot be read"):
        TenantKeys.read(str(tmp_path / "missing.json"))


SCRAPE = """# HELP vllm_bdlora:adapter_requests_total Finished requests per adapter.
# TYPE vllm_bdlora:adapter_requests_total counter
vllm_bdlora:adapter_requests_total{adapter_name="acme-1"} 3.0
vllm_bdlora:adapter_requests_total{adapter_name="globex-1"} 5.0
vllm_bdlora:adapter_requests_total{adapter_name="other"} 9.0
vllm:lora_adapter_loaded{adapter_name="globex-1",rank="0"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
vllm:lora_requests_info{max_lora="2",running_lora_adapters="acme-1,globex-1",waiting_lora_adapters=""} 1.7e9
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_a_tenant_scrapes_only_its_own_adapters_series():
    keys = TenantKeys.parse({"tenants": GOOD}, "keys.json")
    shown = visible_metrics(SCRAPE, keys.tenant_for(f"Bearer {'a' * 20}"))
    assert 'adapter_name="acme-1"' in shown and "num_requests_running" in shown
    assert "globex-1" not in shown and 'adapter_name="other"' not in shown and "lora_requests_info" not in shown


def test_a_tenant_lists_the_base_model_and_only_its_own_adapters():
    keys = TenantKeys.parse({"tenants": GOOD}, "keys.json")
    listing = {"object": "list", "data": [{"id": "base", "parent": None}, {"id": "acme-1", "parent": "base"},
                                          {"id": "globex-1", "parent": "base"}]}  # fmt: skip
    shown = json.loads(visible_models(json.dumps(listing).encode(), keys.tenant_for(f"Bearer {'a' * 20}")))
    assert [m["id"] for m in shown["data"]] == ["base", "acme-1"]
