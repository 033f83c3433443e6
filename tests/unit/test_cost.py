"""C1: exact cost arithmetic for local energy, audio bytes, paid tokens and loads."""

import pytest

from corrallm.config import load_config_text
from corrallm.cost.model import CostModel, Metered

CONFIG = """
costPerKwh: 0.20
commandCosts:
  chat: { generateWattsPerToken: 0.002, processWattsPerToken: 0.0001 }
  stt: { modality: audio, processWattsPerByte: 0.000001, generateWattsPerByte: 0.000002 }
  openai-paid: { paid: true }
models:
  local:
    backends: [{proxy: 9001, type: chat, swap: {loadWatts: 360}}]
  ears:
    backends: [{proxy: 9002, type: stt}]
  paid:
    backends:
      - proxy: https://api.example.com
        type: openai-paid
        pricing: { inputPerMillion: 0.15, outputPerMillion: 0.60 }
        costFactor: 1.5
"""


@pytest.fixture
def setup():
    config = load_config_text(CONFIG)
    return CostModel(config), {n: m.backends[0] for n, m in config.models.items()}


def test_C1_local_energy_is_tokens_times_watts_per_token_at_cost_per_kwh(setup):
    model, b = setup
    price = model.request(b["local"], Metered(prompt_tokens=1000, completion_tokens=500))
    assert price.energy_wh == pytest.approx(1000 * 0.0001 + 500 * 0.002)  # 1.1 Wh
    assert price.cost_usd == pytest.approx(1.1 * 0.20 / 1000)


def test_C1_audio_classes_meter_bytes(setup):
    model, b = setup
    price = model.request(b["ears"], Metered(bytes_in=1_000_000, bytes_out=500))
    assert price.energy_wh == pytest.approx(1.0 + 0.001)
    assert price.cost_usd == pytest.approx(1.001 * 0.20 / 1000)


def test_C1_paid_is_tokens_times_pricing_per_million_times_cost_factor(setup):
    model, b = setup
    price = model.request(b["paid"], Metered(prompt_tokens=2_000_000, completion_tokens=1_000_000))
    assert price.energy_wh == 0
    assert price.cost_usd == pytest.approx((2 * 0.15 + 1 * 0.60) * 1.5)


def test_C1_load_energy_is_seconds_times_load_watts(setup):
    model, b = setup
    price = model.load(b["local"], seconds=30)
    assert price.energy_wh == pytest.approx(30 * 360 / 3600)  # 3 Wh
    assert price.cost_usd == pytest.approx(3 * 0.20 / 1000)


def test_C1_a_backend_of_no_cost_class_costs_nothing():
    config = load_config_text("models: {x: {backends: [{proxy: 9003, type: other}]}}")
    assert CostModel(config).request(config.models["x"].backends[0], Metered(9, 9)).cost_usd == 0


def test_spend_estimate_uses_max_tokens_or_a_default(setup):
    model, b = setup
    assert model.estimate(b["paid"], 4000, 100) == pytest.approx(
        (1000 * 0.15 + 100 * 0.60) / 1e6 * 1.5
    )
    assert model.estimate(b["paid"], 0, None) == pytest.approx(256 * 0.60 / 1e6 * 1.5)


def test_T5_a_lease_costs_its_slot_seconds_at_the_backends_price():
    config = load_config_text(
        """
costPerKwh: 0.20
commandCosts: {chat: {slotWatts: 180}, free: {}, hosted: {paid: true}}
models:
  local: {backends: [{proxy: 9001, type: chat}]}
  unpriced: {backends: [{proxy: 9002, type: free}]}
  paid:
    backends:
      - {proxy: "https://api.example.com", type: hosted, costFactor: 2,
         pricing: {inputPerMillion: 1, perSlotHour: 0.5}}
"""
    )
    model = CostModel(config)
    b = {n: m.backends[0] for n, m in config.models.items()}
    local = model.lease(b["local"], slot_seconds=2 * 3600)  # 2 slot-hours at 180 W
    assert (local.energy_wh, local.cost_usd) == pytest.approx((360, 360 * 0.20 / 1000))
    assert model.lease(b["unpriced"], 7200).cost_usd == 0
    assert model.lease(b["paid"], 1800).cost_usd == pytest.approx(0.5 * 0.5 * 2)
