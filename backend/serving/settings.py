"""Engine settings as strings (Triton's config.pbtxt `parameters`, the Dynamo worker's flags) -> EngineConfig.

Every key is an engine setting (backend/engine/config.py), typed by its field; an unknown key or a value
of the wrong kind is an error naming the key and what is allowed. `model` may be "default" (the model
store prepares SmolLM2 once). Tenant quotas take one string:

    parameters { key: "tenant_quotas" value: { string_value: "gold=running:16,blocks:800; *=running:4" } }

`TENANT=FIELD:N[,FIELD:N]` entries separated by `;`, FIELD one of `running` (sequences in the running batch)
and `blocks` (KV blocks); `*` applies to every named tenant without an entry of its own.
"""

from __future__ import annotations

from typing import Any

from backend.engine.config import EngineConfig, TenantQuota, setting_fields
from backend.serving.model_store import resolve_model_dir

QUOTA_FIELDS = {"running": "max_running", "blocks": "max_blocks"}


def engine_config_from_settings(params: dict[str, str]) -> EngineConfig:
    fields = setting_fields()
    settings: dict[str, Any] = {}
    for key, text in params.items():
        if key not in fields:
            raise ValueError(f"{key}: not an engine setting (known: {sorted(fields)})")
        settings[key] = _parse(key, str(fields[key].type), text)
    settings["model"] = str(resolve_model_dir(settings.get("model", "default")))
    return EngineConfig.create(**settings)


def _parse(key: str, kind: str, text: str) -> Any:
    value = text.strip()
    if key == "tenant_quotas":
        return parse_tenant_quotas(value)
    if value.lower() in ("", "none") and "None" in kind:
        return None
    try:
        if kind.startswith("bool"):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError
            return value.lower() in ("true", "1", "yes", "on")
        if kind.startswith("int"):
            return int(value)
        if kind.startswith("float"):
            return float(value)
    except ValueError:
        raise ValueError(f"{key}: expected {kind.split(' |')[0]}, got {text!r}") from None
    return value


def parse_tenant_quotas(text: str) -> dict[str, TenantQuota]:
    quotas = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        tenant, _, limits = entry.partition("=")
        kwargs = {}
        for item in filter(None, (i.strip() for i in limits.split(","))):
            name, _, number = item.partition(":")
            if name.strip() not in QUOTA_FIELDS or not number.strip().isdigit():
                raise ValueError(f"tenant_quotas: {item!r} in {entry!r}: expected running:N or blocks:N "
                                 f"(syntax: TENANT=running:N,blocks:N; *=running:N)")
            kwargs[QUOTA_FIELDS[name.strip()]] = int(number)
        if not tenant.strip() or not kwargs:
            raise ValueError(f"tenant_quotas: {entry!r}: expected TENANT=running:N,blocks:N")
        quotas[tenant.strip()] = TenantQuota(**kwargs)
    return quotas
