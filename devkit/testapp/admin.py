"""The test app's fenced models in the admin, as a project registers them."""

from django.contrib import admin

from pg_lease_django.admin import FencedModelAdmin

from .models import Invoice


@admin.register(Invoice)
class InvoiceAdmin(FencedModelAdmin):
    list_display = ("account", "status", "amount", "lease_epoch")
