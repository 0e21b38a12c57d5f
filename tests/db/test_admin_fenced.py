"""A FencedModel in the admin (FencedModelAdmin): add, change and delete work as recorded opt-outs."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from devkit.testapp.models import Invoice, Report
from pg_lease_django.admin import UNFENCED_NOTE
from pg_lease_django.checks import check_fenced_models_have_a_fenced_admin

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff(client: Client) -> Client:
    user = User.objects.create_superuser("admin", password="pw")
    client.force_login(user)
    return client


def test_add_change_and_delete_a_fenced_row_from_the_admin(staff: Client, key: str) -> None:
    response = staff.post(
        reverse("admin:testapp_invoice_add"), {"account": key, "status": "draft", "amount": "5"}, follow=True
    )
    assert response.status_code == 200, response.content[:500]
    invoice = Invoice.objects.get(account=key)
    assert (invoice.status, invoice.amount, invoice.lease_id, invoice.lease_epoch) == ("draft", 5, key, None)

    response = staff.post(
        reverse("admin:testapp_invoice_change", args=[invoice.pk]),
        {"account": key, "status": "sent", "amount": "6"},
        follow=True,
    )
    assert response.status_code == 200
    assert Invoice.objects.values_list("status", "amount").get(pk=invoice.pk) == ("sent", 6)

    response = staff.post(reverse("admin:testapp_invoice_delete", args=[invoice.pk]), {"post": "yes"}, follow=True)
    assert response.status_code == 200
    assert not Invoice.objects.filter(pk=invoice.pk).exists()

    entries = list(LogEntry.objects.order_by("pk"))
    assert [entry.action_flag for entry in entries] == [1, 2, 3]  # addition, change, deletion
    assert all(UNFENCED_NOTE in entry.get_change_message() for entry in entries), [
        entry.get_change_message() for entry in entries
    ]


def test_delete_selected_is_a_recorded_opt_out(staff: Client, key: str) -> None:
    for n in range(2):
        staff.post(reverse("admin:testapp_invoice_add"), {"account": f"{key}-{n}", "status": "d", "amount": "1"})
    pks = list(Invoice.objects.filter(account__startswith=key).values_list("pk", flat=True))
    assert len(pks) == 2
    response = staff.post(
        reverse("admin:testapp_invoice_changelist"),
        {"action": "delete_selected", "_selected_action": pks, "post": "yes"},
        follow=True,
    )
    assert response.status_code == 200
    assert not Invoice.objects.filter(pk__in=pks).exists()
    assert LogEntry.objects.filter(action_flag=3, change_message=UNFENCED_NOTE).count() == 2


def test_a_fenced_model_with_a_plain_model_admin_is_warned_about() -> None:
    assert check_fenced_models_have_a_fenced_admin() == []
    admin.site.register(Report)
    try:
        [warning] = check_fenced_models_have_a_fenced_admin()
    finally:
        admin.site.unregister(Report)
    assert (warning.id, warning.obj) == ("pg_lease_django.W001", Report)
    assert "FencedModelAdmin" in (warning.hint or "")


def test_the_opt_out_is_not_left_behind(staff: Client, key: Any) -> None:
    staff.post(reverse("admin:testapp_invoice_add"), {"account": key, "status": "draft", "amount": "1"})
    from pg_lease_django import UnfencedWriteError

    with pytest.raises(UnfencedWriteError):
        Invoice(account=key).save()
